"""`tf32_dot`, the KDA kernels' float32 x float32 product at tf32 precision: its operands are rounded to nearest
tf32 (10 mantissa bits) before the tensor cores read them, which on NVIDIA GPUs would truncate them instead. Runs on
the GPU and on the CPU under the interpreter; on both, the product must be the float64 product of the rounded
operands, up to float32 accumulation."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEV, needs_triton

pytestmark = needs_triton

triton = pytest.importorskip("triton")
tl = triton.language


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest (ties away from zero) onto 10 mantissa bits, in float64, for finite float32 x."""
    mantissa, exponent = torch.frexp(x.double())
    return torch.ldexp(torch.sign(mantissa) * torch.floor(mantissa.abs() * 2.0**11 + 0.5) / 2.0**11, exponent)


if triton is not None:
    from hybrid_attention.ops.kda.triton_utils import _tf32, tf32_dot

    @triton.jit
    def _dot_kernel(a, b, out, N: tl.constexpr):
        offs = tl.arange(0, N)
        at = tl.load(a + offs[:, None] * N + offs[None, :])
        bt = tl.load(b + offs[:, None] * N + offs[None, :])
        tl.store(out + offs[:, None] * N + offs[None, :], tf32_dot(at, bt))

    @triton.jit
    def _round_kernel(x, out, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out + offs, _tf32(tl.load(x + offs)))


def test_rounding_to_nearest_keeps_nan_and_inf():
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-12, -(1 + 2.0**-12 - 2.0**-20), 3.0e-30, float("inf"),
                      float("-inf"), float("nan"), 0.0], dtype=torch.float32, device=DEV)  # fmt: skip
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, N=x.numel())
    finite = torch.isfinite(x)
    assert torch.equal(out[finite].double(), round_to_tf32(x[finite]))
    assert torch.equal(out[~finite].isnan(), x[~finite].isnan()) and torch.equal(out[4:6], x[4:6])


def test_product_of_rounded_operands():
    """Operands just above a tf32 rounding midpoint: truncation moves every one of them down, rounding up; the
    product is the rounded operands' product within float32 accumulation (far below tf32's 2^-11 steps)."""
    gen = torch.Generator().manual_seed(0)
    N = 32

    def above_midpoints():
        """Mantissas 1 + k 2^-10 + 2^-11 + 2^-14 (just above the midpoint of two tf32 neighbours), random signs
        and powers of two."""
        k = torch.randint(0, 1024, (N, N), generator=gen)
        sign = torch.randint(0, 2, (N, N), generator=gen) * 2 - 1
        power = torch.randint(-3, 4, (N, N), generator=gen)
        return (sign * torch.ldexp(1 + k * 2.0**-10 + 2.0**-11 + 2.0**-14, power)).float()

    a, b = above_midpoints(), above_midpoints()
    out = torch.empty(N, N, device=DEV)
    _dot_kernel[(1,)](a.to(DEV), b.to(DEV), out, N=N)
    expect = round_to_tf32(a) @ round_to_tf32(b)
    truncated = (a.view(torch.int32) & ~0x1FFF).view(torch.float32).double()
    scale = expect.abs().max()
    err = (out.cpu().double() - expect).abs().max() / scale
    assert err < 1e-6, f"max error {err:.2e} of the largest product"
    assert (truncated @ round_to_tf32(b) - expect).abs().max() / scale > 1e-5, "the operands do not tell rounding apart"
