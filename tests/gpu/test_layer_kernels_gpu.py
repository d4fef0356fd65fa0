"""The KDA layer on CUDA in bf16: its fused short conv and gated output norm (Triton) against the eager modules.

Forward and every parameter / input gradient of a whole KimiDeltaAttention layer, with the two fused paths on and
then off (the layers' dispatch patched to eager), at DESIGN.md's bf16 tolerances.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.layers import conv, norm
from hybrid_attention.layers.kda import KimiDeltaAttention
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_()
    y = layer(xx)
    y.backward(dy)
    return y, xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_fused_conv_and_norm_match_eager(monkeypatch):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(256, 2, head_dim=128).to("cuda", torch.bfloat16)
    x = torch.randn(2, 333, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, dx, grads = _run(layer, x, dy)
    for module in (conv, norm):
        monkeypatch.setattr(module, "triton_runs_on", lambda *a, **k: False)
    y_ref, dx_ref, grads_ref = _run(layer, x, dy)
    assert_close("layer output", y, y_ref, 1e-2)
    assert_close("dx", dx, dx_ref, 2e-2)
    for name, g in grads.items():
        assert_close(f"d{name}", g, grads_ref[name], 2e-2)


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
