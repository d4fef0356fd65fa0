"""The fused Triton kernels behind the KDA layer's short conv and gated output norm, against their eager references.

Run under the Triton interpreter on CPU (float32, tiny shapes) or on a GPU. Each compares the output and every
gradient on fresh random inputs, at odd sizes (partial time / channel / row blocks), and checks that the conv is
causal. The layer uses these kernels on CUDA only; tests/gpu/layers/test_kernels_gpu.py checks that path in bf16.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.layers.conv import ShortConv
from hybrid_attention.layers.norm import GatedRMSNorm
from hybrid_attention.ops.backends import use_reference
from hybrid_attention.ops.gated_norm import gated_rms_norm
from hybrid_attention.ops.short_conv import naive_short_conv, short_conv
from tests.helpers import DEV, assert_close, needs_triton, poisoned_like

pytestmark = needs_triton
TOL = 1e-5


def grads_of(fn, inputs, dy):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y, [x.grad for x in leaves]


# T = 70 and 130 span several 32-step segments (the kernels' halo rows); C = 600 spans two 512-channel blocks.
@pytest.mark.parametrize(
    "B, T, C, W", [(2, 70, 130, 4), (1, 1, 8, 4), (1, 5, 16, 1), (3, 130, 16, 3), (1, 40, 600, 2), (2, 33, 8, 4)]
)
def test_short_conv_matches_reference(B, T, C, W):
    gen = torch.Generator().manual_seed(T * C + W)
    x = torch.randn(B, T, C, generator=gen).to(DEV)
    w = torch.randn(C, W, generator=gen).to(DEV)
    dy = torch.randn(B, T, C, generator=gen).to(DEV)
    y, (dx, dw) = grads_of(short_conv, (x, w), dy)
    yr, (dxr, dwr) = grads_of(naive_short_conv, (x.double(), w.double()), dy.double())
    assert y.dtype == x.dtype
    for name, a, b in (("y", y, yr), ("dx", dx, dxr), ("dw", dw, dwr)):
        assert_close(f"short_conv {name}", a, b, TOL)


def test_short_conv_is_causal_and_writes_everything(monkeypatch):
    x = torch.randn(2, 80, 24, device=DEV)
    w = torch.randn(24, 4, device=DEV)
    dy = torch.randn_like(x)
    monkeypatch.setattr(torch, "empty_like", poisoned_like)  # an element the kernels forget stays NaN
    y, (dx, _) = grads_of(short_conv, (x, w), dy)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    x2 = x.clone()
    x2[:, 50:] += 1.0
    y2 = short_conv(x2, w)
    assert torch.equal(y[:, :50], y2[:, :50]) and not torch.equal(y[:, 50:], y2[:, 50:])
    # The gradient flows backwards in time: dy from row 50 on reaches dx from row 47 (4 taps) on, not before.
    dy2 = dy.clone()
    dy2[:, 50:] += 1.0
    _, (dx2, _) = grads_of(short_conv, (x, w), dy2)
    assert torch.equal(dx[:, :47], dx2[:, :47]) and not torch.equal(dx[:, 47:50], dx2[:, 47:50])


def test_short_conv_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"x must be \[B, T, C\] and weight \[C, W\]"):
        short_conv(torch.randn(2, 5, 8, device=DEV), torch.randn(7, 4, device=DEV))
    with pytest.raises(ValueError, match="take 1 to 4 taps, got a kernel of size 5"):
        short_conv(torch.randn(2, 5, 8, device=DEV), torch.randn(8, 5, device=DEV))


@pytest.mark.parametrize("shape", [(2, 5, 3, 16), (1, 1, 1, 20), (37, 128)])
def test_gated_norm_matches_module(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    D = shape[-1]
    x, gate, dy = (torch.randn(*shape, generator=gen).to(DEV) for _ in range(3))
    weight = torch.randn(D, generator=gen).to(DEV)
    y, grads = grads_of(lambda a, b, c: gated_rms_norm(a, b, c, 1e-6), (x, gate, weight), dy)
    # float64 inputs never take the Triton path, so the module itself gives the reference.
    yr, grads_r = grads_of(lambda a, b, c: _module_forward(a, b, c), (x.double(), gate.double(), weight.double()), dy)
    assert_close("gated norm y", y, yr, TOL)
    for name, a, b in zip(("dx", "dgate", "dweight"), grads, grads_r, strict=True):
        assert_close(f"gated norm {name}", a, b, TOL)


def _module_forward(x, gate, weight):
    mod = GatedRMSNorm(x.shape[-1], eps=1e-6).to(device=x.device, dtype=x.dtype)
    del mod.weight
    mod.weight = weight  # a plain tensor keeps the autograd graph to `weight`
    return mod(x, gate)


def test_gated_norm_rejects_mismatched_gate():
    with pytest.raises(ValueError, match="gate must have x's shape"):
        gated_rms_norm(torch.randn(2, 8, device=DEV), torch.randn(2, 4, device=DEV), torch.ones(8, device=DEV), 1e-6)


@pytest.mark.parametrize("W", [4, 1])
def test_short_conv_layer_with_cache_matches_eager(W):
    """ShortConv's Triton path with a cache (prefill in pieces, what the layer runs on CUDA) against its eager
    conv1d path: outputs per piece and the cache after each, from a non-zero left context."""
    torch.manual_seed(W)
    layer = ShortConv(24, kernel_size=W).to(DEV)
    x = torch.randn(2, 37, 24, device=DEV)
    fused_cache = torch.randn(2, 24, W - 1, device=DEV)
    eager_cache = fused_cache.clone()
    with torch.no_grad(), use_reference():  # layer(...) takes the eager path
        for piece in (x[:, :1], x[:, 1:20], x[:, 20:]):
            y = layer._fused(piece, fused_cache)
            assert_close(f"piece of {piece.shape[1]}", y, layer(piece, eager_cache), TOL)
            assert_close("cache", fused_cache, eager_cache, 1e-12)
