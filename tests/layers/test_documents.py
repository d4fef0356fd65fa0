"""Packed documents (`cu_seqlens`): every layer and the whole model give, in float64, the outputs and gradients of
each document run alone (layers/documents.py, conv.py, kda.py, mla.py, model.py, ops/mla/varlen.py,
ops/short_conv.py)."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.layers import GatedMLA, KimiDeltaAttention
from hybrid_attention.layers.conv import ShortConv
from hybrid_attention.layers.documents import PackedDocuments
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close, needs_triton

LENGTHS = [5, 1, 23, 2, 9]  # odd lengths, a one-token document, a document longer than a chunk of 16


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _per_document(fn, x, lengths):
    """fn applied to each document of x [1, T, ...] alone, concatenated along T."""
    bounds = _cu(lengths).tolist()
    return torch.cat([fn(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1)


def _grads(module, *tensors):
    return [t.grad for t in tensors] + [p.grad for p in module.parameters() if p.grad is not None]


def _check_layer(layer, x, lengths, tol=1e-12):
    """Forward and every gradient of `layer` on packed documents against each document alone."""
    weight = torch.randn(x.shape[:2] + (layer(x[:, :1]).shape[-1],), dtype=x.dtype)
    packed_in = x.clone().requires_grad_()
    out = layer(packed_in, cu_seqlens=_cu(lengths))
    (out * weight).sum().backward()
    packed = _grads(layer, packed_in)
    layer.zero_grad()
    alone_in = x.clone().requires_grad_()
    ref = _per_document(layer, alone_in, lengths)
    (ref * weight).sum().backward()
    assert_close("output", out, ref, tol)
    for i, (a, b) in enumerate(zip(packed, _grads(layer, alone_in), strict=True)):
        assert_close(f"gradient {i}", a, b, tol)


def test_packed_documents_positions_and_checks():
    docs = PackedDocuments.of(torch.tensor([0, 2, 2, 5]), 5, torch.device("cpu"))
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2]] and docs.max_len == 3 and docs.num_documents == 3
    for bad, message in (
        (torch.tensor([0, 3, 2, 5]), "rise from 0"),
        (torch.tensor([1, 5]), "rise from 0"),
        (torch.tensor([0, 4]), "to the 5 tokens"),
        (torch.tensor([0.0, 5.0]), "int32 or int64"),
        (torch.tensor([5]), r"\[N \+ 1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            PackedDocuments.of(bad, 5, torch.device("cpu"))


def test_short_conv_starts_every_document_from_zeros():
    torch.manual_seed(0)
    conv = ShortConv(12, 4).double()
    x = torch.randn(1, sum(LENGTHS), 12, dtype=torch.float64)
    positions = PackedDocuments.of(_cu(LENGTHS), x.shape[1], x.device).positions
    packed_in = x.clone().requires_grad_()
    out = conv(packed_in, positions=positions)
    out.sum().backward()
    alone_in = x.clone().requires_grad_()
    ref = _per_document(conv, alone_in, LENGTHS)
    assert_close("conv", out, ref, 1e-12)
    ref.sum().backward()
    assert_close("conv dx", packed_in.grad, alone_in.grad, 1e-12)
    with pytest.raises(ValueError, match="take no cache"):
        conv(x, conv.empty_cache(1, dtype=torch.float64), positions=positions)


@needs_triton
def test_short_conv_kernel_with_positions_matches_each_document():
    from hybrid_attention.ops.short_conv import naive_short_conv, short_conv

    torch.manual_seed(1)
    lengths = [3, 1, 40, 2, 31]  # documents across the kernel's 32-step segments
    x = torch.randn(1, sum(lengths), 20, requires_grad=True)
    w = torch.randn(20, 4, requires_grad=True)
    positions = PackedDocuments.of(_cu(lengths), x.shape[1], x.device).positions
    g = torch.randn(1, sum(lengths), 20)
    out = short_conv(x, w, positions)
    dx, dw = torch.autograd.grad((out * g).sum(), (x, w))
    ref = _per_document(lambda part: naive_short_conv(part, w), x, lengths)
    rdx, rdw = torch.autograd.grad((ref * g).sum(), (x, w))
    for name, a, b in (("y", out, ref), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize("gate", ["bounded", "head"])
def test_kda_layer_runs_each_document_as_its_own_sequence(gate):
    torch.manual_seed(2)
    layer = KimiDeltaAttention(24, 2, head_dim=8, gate=gate, backend="torch").double()
    _check_layer(layer, torch.randn(1, sum(LENGTHS), 24, dtype=torch.float64), LENGTHS)


def test_mla_attends_within_each_document():
    torch.manual_seed(3)
    layer = GatedMLA(24, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_shared_head_dim=4, v_head_dim=6).double()
    _check_layer(layer, torch.randn(1, sum(LENGTHS), 24, dtype=torch.float64), LENGTHS)


def test_layers_refuse_a_batch_or_a_cache_with_packed_documents():
    kda = KimiDeltaAttention(24, 2, head_dim=8)
    mla = GatedMLA(24, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_shared_head_dim=4, v_head_dim=6)
    cu = torch.tensor([0, 3, 6])
    for layer, cache in ((kda, kda.empty_cache(1)), (mla, mla.empty_cache(1, 8))):
        with pytest.raises(ValueError, match="B == 1 without a cache"):
            layer(torch.randn(2, 6, 24), cu_seqlens=cu)
        with pytest.raises(ValueError, match="B == 1 without a cache"):
            layer(torch.randn(1, 6, 24), cache=cache, cu_seqlens=cu)


def _model(residual: str) -> HybridLM:
    torch.manual_seed(4)
    extra = {"attnres_block_size": 2} if residual == "block_attnres" else {}
    config = HybridConfig.from_preset(
        "tiny",
        hidden_size=32,
        intermediate_size=48,
        kda_head_dim=16,
        mla_kv_lora_rank=16,
        mla_v_head_dim=16,
        residual=residual,
        **extra,
    )
    model = HybridLM(config, kda_backend="torch", attnres_backend="torch").double()
    with torch.no_grad():  # pseudo-queries away from zero, so that AttnRes mixes its sources unevenly
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_()
    return model


@pytest.mark.parametrize("residual", ["standard", "attnres", "block_attnres"])
def test_model_logits_loss_and_gradients_equal_each_document_alone(residual):
    model = _model(residual)
    ids = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(5))
    out = model(ids, labels=ids, cu_seqlens=_cu(LENGTHS))
    out.loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    bounds = _cu(LENGTHS).tolist()
    logits, total, count = [], 0.0, 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        alone = model(ids[:, a:b], labels=ids[:, a:b])
        logits.append(alone.logits)
        total, count = total + alone.loss * (b - a - 1), count + b - a - 1  # each predicts its own b - a - 1 tokens
    (total / count).backward()
    assert_close("logits", out.logits, torch.cat(logits, dim=1), 1e-12)
    assert abs(out.loss.item() - (total / count).item()) < 1e-12
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_close(name, packed[name], p.grad, 1e-10)
    with torch.no_grad():  # Full AttnRes without autograd takes its inference path
        assert_close("no_grad logits", model(ids, cu_seqlens=_cu(LENGTHS)).logits, out.logits, 1e-12)


def test_model_refuses_packed_documents_with_a_batch_or_a_cache():
    model = HybridLM(HybridConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=r"input_ids \[1, T\] without a cache"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"input_ids \[1, T\] without a cache"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=model.make_cache(1, 8), cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.parametrize("api", ["scale_and_window", "is_causal_only"])
@pytest.mark.parametrize("dims", [(12, 6), (6, 12)])
def test_flash_call_pads_head_dims_and_keeps_the_scale(monkeypatch, api, dims):
    """torch's varlen flash attention (CUDA only) stood in for by per-document SDPA with the same keyword API: the
    call pads q, k and v to one head dimension and keeps the MLA scale, in torch's newer API (scale, window_size)
    and in torch 2.10's (is_causal, scale dim ** -0.5)."""
    import inspect

    import torch.nn.functional as F

    from hybrid_attention.ops.mla import varlen

    def per_document(q, k, v, cu, scale):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0  # flash takes one head dim
        bounds = cu.tolist()
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
            parts.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(parts)

    def new_api(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        assert tuple(window_size) == (-1, 0)
        return per_document(query, key, value, cu_seq_q, scale)

    def old_api(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert is_causal
        return per_document(query, key, value, cu_seq_q, query.shape[-1] ** -0.5)

    fake = new_api if api == "scale_and_window" else old_api
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: (fake, set(inspect.signature(fake).parameters)))
    torch.manual_seed(6)
    d_qk, d_v = dims
    q, k = torch.randn(2, sum(LENGTHS), 3, d_qk, dtype=torch.float64).unbind(0)
    v = torch.randn(sum(LENGTHS), 3, d_v, dtype=torch.float64)
    cu = _cu(LENGTHS)
    out = varlen._flash(q, k, v, cu, max(LENGTHS), 0.3)
    assert_close("flash call", out, varlen.causal_varlen_attention(q, k, v, cu, max(LENGTHS), scale=0.3), 1e-12)
