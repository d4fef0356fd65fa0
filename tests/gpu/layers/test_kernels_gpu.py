"""The KDA layer on CUDA in bf16: its fused short conv and gated output norm (Triton) against the eager modules.

Forward and every parameter / input gradient of a whole KimiDeltaAttention layer, with the two fused paths on and
then off (the layers' dispatch patched to eager): the fused path must be as accurate as the eager one against the
same layer in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_attention.layers import conv, norm
from hybrid_attention.layers.kda import KimiDeltaAttention
from hybrid_attention.ops.short_conv import naive_short_conv
from tests.helpers import assert_as_accurate, assert_close, needs_cuda

pytestmark = needs_cuda


def _run(layer, x, dy) -> dict[str, torch.Tensor]:
    """The layer's output, input gradient and parameter gradients, by name."""
    layer.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_()
    y = layer(xx)
    y.backward(dy)
    return {"layer output": y, "dx": xx.grad, **{f"d{n}": p.grad.clone() for n, p in layer.named_parameters()}}


def test_fused_conv_and_norm_as_accurate_as_eager(monkeypatch):
    """Against the float64 layer, every quantity within 2x of the eager bf16 modules' error (or within bf16's unit
    roundoff 2^-8). Compared with each other at a fixed 2e-2, two bf16 paths differed by 2.8e-2 in dA_log (at 2 heads
    a two-element sum with cancellation), which measures its conditioning, not a fault of either path."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(1024, 8, head_dim=128).to("cuda", torch.bfloat16)
    layer64 = copy.deepcopy(layer).double()  # float32 would run tf32 products: not a reference for bf16
    x = torch.randn(2, 333, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    fused = _run(layer, x, dy)
    for module in (conv, norm):
        monkeypatch.setattr(module, "use_triton", lambda *a, **k: False)
    eager = _run(layer, x, dy)
    ref = _run(layer64, x.double(), dy.double())
    assert fused.keys() == eager.keys() == ref.keys()
    for name, value in fused.items():
        assert_as_accurate(name, value.float(), ref[name], eager[name].float(), floor=2.0**-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_conv_prefill_equals_whole_prompt(dtype):
    """A prompt fed in pieces through the cache gives bit for bit the whole-prompt outputs (same kernel), and the
    cache ends holding the last inputs: chunked prefill and decoding start from the same numbers as training."""
    torch.manual_seed(1)
    layer = conv.ShortConv(96).to("cuda", dtype)
    x = torch.randn(3, 70, 96, device="cuda", dtype=dtype)
    with torch.no_grad():
        whole = layer(x)
        cache = layer.empty_cache(3)
        pieces = torch.cat([layer(x[:, :1], cache), layer(x[:, 1:41], cache), layer(x[:, 41:], cache)], dim=1)
    assert torch.equal(pieces, whole)
    assert torch.equal(cache, x[:, -3:].transpose(1, 2).to(cache.dtype))


def test_conv_longer_than_the_kernels_taps_runs_eager():
    """A kernel of 5 taps (the Triton kernels take 4) runs conv1d on CUDA, with the reference's result."""
    torch.manual_seed(2)
    layer = conv.ShortConv(40, kernel_size=5).to("cuda")
    x = torch.randn(2, 50, 40, device="cuda")
    with torch.no_grad(), torch.backends.cudnn.flags(allow_tf32=False):  # cuDNN's default TF32 rounds to 2^-11
        y = layer(x)
    reference = naive_short_conv(x.double(), layer.weight.view(40, 5).double())
    assert_close("5-tap conv", y, reference, 1e-5)
