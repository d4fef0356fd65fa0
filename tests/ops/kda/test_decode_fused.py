"""Fused one-token KDA decode (`ops.kda.decode_fused`, Triton interpreter on CPU): the layer's fused step against its
eager step (outputs, conv tails, recurrent state) over several tokens, float32 and bf16, odd head dims, conv sizes."""

from __future__ import annotations

import copy

import pytest
import torch

import hybrid_attention.layers.kda as kda
from hybrid_attention.layers.kda import KimiDeltaAttention
from hybrid_attention.ops.backends import use_reference
from tests.helpers import DEV, assert_close

triton = pytest.importorskip("triton")
from hybrid_attention.ops.triton_support import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)


def make_layer(head_dim, conv_size, dtype, seed):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(24, 3, head_dim=head_dim, conv_size=conv_size).to(DEV, dtype)
    with torch.no_grad():  # make every parameter matter
        layer.g_up.bias.normal_()
        layer.o_norm.weight.uniform_(0.5, 1.5)
        layer.A_log.normal_(0.0, 0.5)
    return layer


HALF = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])  # the interpreter truncates bf16


@pytest.mark.parametrize("head_dim, conv_size", [(8, 4), (12, 2), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_fused_step_equals_eager_step(head_dim, conv_size, dtype, monkeypatch):
    """float32: fused == eager to 1e-5 (outputs, state), tails bit-identical. 16-bit: both within 1e-2 of the
    float64 layer with the same (rounded) weights and inputs."""
    monkeypatch.setattr(kda, "_fused_decode_ok", lambda x, conv_size: False)  # layer(...) stays eager, even on CUDA
    layer = make_layer(head_dim, conv_size, dtype, seed=head_dim)
    x = torch.randn(2, 9, 24, device=DEV, dtype=dtype)
    with torch.no_grad():
        eager = layer.empty_cache(2)
        layer(x[:, :5], eager)  # a prefix through the chunked path, so tails and state are not zero
        fused = copy.deepcopy(eager)
        outs_e, outs_f = [], []
        for t in range(5, 9):
            outs_e.append(layer(x[:, t : t + 1], eager))
            outs_f.append(layer._decode_fused(x[:, t : t + 1], fused))
        # float64 on the CPU (the CUDA chunk kernels take 16/32-bit inputs only).
        ref = copy.deepcopy(layer).cpu().double()(x.cpu().double())[:, 5:].to(DEV)
    out_f, out_e = torch.cat(outs_f, 1), torch.cat(outs_e, 1)
    assert out_f.dtype == dtype and out_f.shape == (2, 4, 24)
    for name in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(getattr(fused, name), getattr(eager, name)), f"{name}: the tail shift differs"
    if dtype == torch.float32:
        assert_close("outputs", out_f, out_e, 1e-5)
        assert_close("state", fused.state, eager.state, 1e-5)
    else:
        assert_close(f"eager {dtype} vs float64", out_e, ref, 1e-2)
        assert_close(f"fused {dtype} vs float64", out_f, ref, 1e-2)
        assert_close(f"fused {dtype} state vs eager", fused.state, eager.state, 1e-2)


def test_the_layer_takes_the_fused_path_on_cuda_only():
    """On CUDA, without autograd and outside `use_reference()`; never for float64 or a conv of one tap."""
    x = torch.randn(1, 1, 24, device=DEV)
    with torch.no_grad():
        assert kda._fused_decode_ok(x, 4) == torch.cuda.is_available()
        assert not kda._fused_decode_ok(x.double(), 4) and not kda._fused_decode_ok(x, 1)
        with use_reference():
            assert not kda._fused_decode_ok(x, 4)
    assert not kda._fused_decode_ok(x, 4), "the fused kernels have no backward"


def test_fused_step_with_packed_projections(monkeypatch):
    """The fused step reading its projections as slices of one packed product (what a decode step passes):
    the same outputs, tails and state as with separate projections (float32; the packed product may round its
    last bit differently)."""
    from hybrid_attention.layers.packed import PackedProjections

    layer = make_layer(8, 4, torch.float32, seed=3)
    x = torch.randn(2, 4, 24, device=DEV)
    caches = [layer.empty_cache(2) for _ in range(2)]
    outs = []
    with torch.no_grad():
        for cache, packed in zip(caches, (None, PackedProjections(layer)), strict=True):
            outs.append(torch.cat([layer._decode_fused(x[:, t : t + 1], cache, packed) for t in range(4)], 1))
    assert_close("outputs", outs[1], outs[0], 1e-6)
    assert_close("state", caches[1].state, caches[0].state, 1e-6)
    for name in ("conv_q", "conv_k", "conv_v"):  # the tails hold projection outputs: one product's rounding
        assert_close(name, getattr(caches[1], name), getattr(caches[0], name), 1e-6)
