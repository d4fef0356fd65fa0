"""Fused inference AttnRes + RMSNorm (`ops.attnres.mix_norm.attn_res_norm`): the Triton kernel (interpreter on CPU)
against the PyTorch composition, sources read from a larger NaN-poisoned buffer, and the model's inference path
(sources buffer + fused op) against its training path."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.attnres.mix_norm import _attn_res_norm_triton, attn_res_norm
from hybrid_attention.ops.attnres.naive import naive_attn_res
from hybrid_attention.ops.numerics import rms_norm
from hybrid_attention.ops.triton_support import interpreting
from tests.helpers import DEV, assert_close

triton = pytest.importorskip("triton")
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)


def make_sources(S, D, *, slots=None, seed=0):
    """A [slots, 2, 3, D] buffer whose first S slots hold sources of very different scales; the rest are NaN."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((slots or S, 2, 3, D), float("nan"), dtype=torch.float64)
    scales = torch.rand(S, 1, 1, 1, generator=g, dtype=torch.float64) * 4 + 0.1
    buf[:S] = torch.randn(S, 2, 3, D, generator=g, dtype=torch.float64) * scales
    params = [torch.randn(D, generator=g, dtype=torch.float64), 0.5 + torch.rand(D, generator=g, dtype=torch.float64)]
    params.append(0.5 + torch.rand(D, generator=g, dtype=torch.float64))
    return buf, *params


def composition(sources, query, key_weight, norm_weight, eps=1e-6, norm_eps=1e-5):
    """The unfused float64 reference: AttnRes over the list of sources, then RMSNorm."""
    h = naive_attn_res(list(sources.double()), query.double(), key_weight.double(), eps)
    return h if norm_weight is None else rms_norm(h, norm_weight.double(), norm_eps)


@needs_triton
@pytest.mark.parametrize("S", [1, 4, 9])
@pytest.mark.parametrize(
    "D, block_s, block_d", [(48, None, None), (48, 2, None), (40, 4, None), (40, None, 16), (64, None, 16)]
)
@pytest.mark.parametrize("with_norm", [True, False])
def test_triton_matches_composition(S, D, block_s, block_d, with_norm):
    """One pass over all sources, one pass in chunks of block_s sources (online softmax), and D-chunked passes."""
    buf, query, key_weight, norm_weight = make_sources(S, D, slots=S + 3, seed=S * D)
    norm_weight = norm_weight if with_norm else None
    ref = composition(buf[:S], query, key_weight, norm_weight)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        sources = buf.to(dtype).to(DEV)[:S]  # a view of the first S slots; the NaN slots must never be read
        args = [t.float().to(DEV) for t in (query, key_weight)]
        nw = None if norm_weight is None else norm_weight.float().to(DEV)
        out = _attn_res_norm_triton(sources, *args, 1e-6, nw, 1e-5, block_s=block_s, block_d=block_d)
        assert out.dtype == dtype and out.shape == (2, 3, D)
        assert_close(f"triton S={S} D={D} {dtype}", out, ref.to(out.device), tol)


@needs_triton
@pytest.mark.parametrize("block_s, block_d", [(None, None), (4, None), (1, None), (None, 16)])
def test_latest_source_is_stored_into_its_slot(block_s, block_d):
    """With `latest`, slot S - 1 may hold garbage (NaN) before the call: the kernel uses and stores `latest`."""
    S, D = 6, 40
    buf, query, key_weight, norm_weight = make_sources(S, D, slots=S + 2, seed=7)
    ref = composition(buf[:S], query, key_weight, norm_weight)
    latest = buf[S - 1].clone()
    for backend in ("triton", "torch"):
        work = buf.float().to(DEV)
        work[S - 1] = float("nan")
        lat = latest.float().to(DEV)
        args = (work[:S], query.float().to(DEV), key_weight.float().to(DEV), 1e-6, norm_weight.float().to(DEV), 1e-5)
        if backend == "triton":
            out = _attn_res_norm_triton(*args, latest=lat, block_s=block_s, block_d=block_d)
        else:
            out = attn_res_norm(*args[:4], norm_weight=args[4], norm_eps=1e-5, latest=lat, backend="torch")
        assert_close(f"{backend} with latest", out, ref.to(out.device), 1e-5)
        assert torch.equal(work[S - 1], lat), f"{backend}: latest was not stored into slot S - 1"
        assert torch.isnan(work[S:]).all(), f"{backend}: slots past S were written"


@needs_triton
def test_triton_backend_through_the_public_function():
    buf, query, key_weight, norm_weight = make_sources(5, 48, seed=1)
    sources = buf.float().to(DEV)
    out = attn_res_norm(
        sources,
        query.float().to(DEV),
        key_weight.float().to(DEV),
        norm_weight=norm_weight.float().to(DEV),
        norm_eps=1e-5,
        backend="triton",
    )
    assert_close("public triton", out, composition(buf, query, key_weight, norm_weight).to(out.device), 1e-5)
    with pytest.raises(ValueError, match="inference-only"):
        attn_res_norm(sources, query.float().to(DEV).requires_grad_(), key_weight.float().to(DEV), backend="triton")


def test_torch_backend_is_the_exact_composition():
    buf, query, key_weight, norm_weight = make_sources(6, 24, slots=8, seed=2)
    out = attn_res_norm(buf[:6], query, key_weight, norm_weight=norm_weight, norm_eps=1e-5, backend="auto")
    assert torch.equal(out, composition(buf[:6], query, key_weight, norm_weight))
    plain = attn_res_norm(buf[:6], query, key_weight, backend="torch")
    assert torch.equal(plain, composition(buf[:6], query, key_weight, None))


def test_bad_inputs():
    buf, query, key_weight, norm_weight = make_sources(3, 16)
    with pytest.raises(ValueError, match="backend"):
        attn_res_norm(buf, query, key_weight, backend="cuda")
    with pytest.raises(ValueError, match=r"query must have shape \[16\]"):
        attn_res_norm(buf, query[:8], key_weight)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[16\]"):
        attn_res_norm(buf, query, key_weight, norm_weight=norm_weight[:3])
    with pytest.raises(ValueError, match="stacked tensor"):
        attn_res_norm(buf[:0], query, key_weight)
    with pytest.raises(ValueError, match="floating"):
        attn_res_norm(buf.long(), query, key_weight)
    with pytest.raises(ValueError, match="latest must be"):
        attn_res_norm(buf, query, key_weight, latest=buf[0, :1])


def test_model_inference_path_equals_training_path():
    """Without autograd a Full-AttnRes model writes sources into one buffer and fuses each AttnRes with its
    sublayer's RMSNorm; with autograd it takes the list path. Same logits (float64), with a cache too."""
    torch.manual_seed(3)
    model = HybridLM(HybridConfig.from_preset("tiny"), kda_backend="torch").double()
    for name, p in model.named_parameters():
        if name.endswith(".query") or "_res.key_norm" in name or name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5) if "norm" in name else p.data.normal_()
    ids = torch.randint(0, 256, (2, 13))
    training = model(ids).logits.detach()
    with torch.no_grad():
        inference = model(ids).logits
    assert_close("inference vs training path", inference, training, 1e-12)
    cache = model.make_cache(2, 13)
    with torch.no_grad():
        pieces = [model(ids[:, :8], cache=cache).logits]
        pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(8, 13)]
    assert_close("cached inference vs training path", torch.cat(pieces, dim=1), training, 1e-10)
