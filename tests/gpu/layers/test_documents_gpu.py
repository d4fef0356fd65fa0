"""Packed documents on CUDA: the varlen short-conv kernel, torch's varlen flash attention in MLA, the varlen KDA kernels
in the layer, and the whole model in bf16 against each document run alone; and `train --doc-mask` on the GPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.layers import GatedMLA, KimiDeltaAttention
from hybrid_attention.layers.documents import PackedDocuments
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.mla.varlen import flash_supported
from hybrid_attention.ops.short_conv import naive_short_conv, short_conv
from tests.helpers import assert_as_accurate, assert_close, needs_cuda

pytestmark = needs_cuda

LENGTHS = [1, 130, 7, 64, 65, 300, 33]  # a one-token document, chunk edges (64), segment edges (32)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _per_document(fn, x, lengths):
    bounds = _cu(lengths).tolist()
    return torch.cat([fn(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1)


def _outputs_and_grads(layer, x, dy, *, packed: bool):
    layer.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_()
    y = layer(xx, cu_seqlens=_cu(LENGTHS)) if packed else _per_document(layer, xx, LENGTHS)
    y.backward(dy)
    return {"output": y, "dx": xx.grad, **{f"d{n}": p.grad.clone() for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_kernel_with_positions(dtype):
    torch.manual_seed(0)
    x = torch.randn(1, sum(LENGTHS), 1024, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(1024, 4, device="cuda", requires_grad=True)
    positions = PackedDocuments.of(_cu(LENGTHS), x.shape[1], x.device).positions
    g = torch.randn_like(x)
    out = short_conv(x, w, positions)
    dx, dw = torch.autograd.grad((out.float() * g).sum(), (x, w))
    ref = _per_document(lambda part: naive_short_conv(part, w), x, LENGTHS)
    rdx, rdw = torch.autograd.grad((ref.float() * g).sum(), (x, w))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in (("y", out, ref), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert_close(name, a, b, tol)


@pytest.mark.parametrize("layer_kind", ["kda", "mla"])
def test_layers_on_packed_documents_as_accurate_as_each_document_alone(layer_kind):
    """bf16 on CUDA (varlen KDA kernels, varlen flash attention) against the same layer in float64 per document:
    within 2x of the error of the bf16 layer run per document."""
    torch.manual_seed(1)
    if layer_kind == "kda":
        layer = KimiDeltaAttention(1024, 8, head_dim=128)
    else:
        layer = GatedMLA(1024, 8, kv_lora_rank=256, qk_nope_head_dim=96, qk_shared_head_dim=32, v_head_dim=128)
        assert flash_supported(
            torch.empty(1, 1, 128, device="cuda", dtype=torch.bfloat16),
            torch.empty(1, 1, 128, device="cuda", dtype=torch.bfloat16),
        )
    layer = layer.to("cuda", torch.bfloat16)
    layer64 = copy.deepcopy(layer).double()
    x = torch.randn(1, sum(LENGTHS), 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    packed = _outputs_and_grads(layer, x, dy, packed=True)
    alone = _outputs_and_grads(layer, x, dy, packed=False)
    ref = _outputs_and_grads(layer64, x.double(), dy.double(), packed=False)
    for name in ref:
        assert_as_accurate(name, packed[name], ref[name], alone[name], factor=2.0, floor=4e-3)


@pytest.mark.parametrize("residual", ["attnres", "standard"])
def test_model_in_bf16_on_packed_documents(residual):
    torch.manual_seed(2)
    config = HybridConfig.from_preset(
        "k3-scaled",
        residual=residual,
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        kda_num_heads=4,
        mla_num_heads=4,
    )
    model = HybridLM(config).cuda()
    ids = torch.randint(0, 512, (1, sum(LENGTHS)), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        out = model(ids, labels=ids, cu_seqlens=_cu(LENGTHS))
        bounds = _cu(LENGTHS).tolist()
        alone = [model(ids[:, a:b]).logits for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert_close("logits", out.logits.float(), torch.cat(alone, dim=1).float(), 2e-2)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_doc_mask_training_on_the_gpu(tmp_path):
    from hybrid_attention.training.config import TrainConfig
    from hybrid_attention.training.loop import train

    config = TrainConfig.create(
        out=str(tmp_path / "run"),
        steps=3,
        batch_size=4,
        seq_len=256,
        eval_every=3,
        eval_batches=1,
        log_every=1,
        data_max_bytes=400_000,
        doc_mask=True,
    )
    summary = train(config, echo=lambda *a: None)
    assert summary["step"] == 3 and math.isfinite(summary["val_loss"])
