"""act(a) * b in one Triton kernel, for inference: SwiGLU's SiLU(gate) * up and Gated MLA's sigmoid(gate) * o, rounded
as the eager ops round (docs/kernels.md, "Norms, SwiGLU, act_mul, the decode GEMV and the chunked cross-entropy").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.triton_support import as_rows

ACTS = ("silu", "sigmoid")


@triton.jit
def _act_mul_kernel(
    a, b, y, width, stride_a, stride_b, SILU: tl.constexpr, BLOCK: tl.constexpr, CDT: tl.constexpr = tl.float32
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    av = tl.load(a + row * stride_a + cols, mask=ok, other=0.0)
    bv = tl.load(b + row * stride_b + cols, mask=ok, other=0.0).to(CDT)
    af = av.to(CDT)
    act = af * tl.sigmoid(af) if SILU else tl.sigmoid(af)
    act = act.to(av.dtype).to(CDT)
    tl.store(y + row * width + cols, (act * bv).to(y.dtype.element_ty), mask=ok)


def act_mul(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """act(a) * b for a, b of one shape and dtype [..., width] (each may be a slice with a row stride): a new
    contiguous tensor of that shape, as `act(a) * b` in eager PyTorch computes it."""
    if act not in ACTS:
        raise ValueError(f"act_mul: act must be one of {ACTS}, got {act!r}")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"act_mul: a and b must match, got {a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    width = a.shape[-1]
    a2, b2 = as_rows(a, width), as_rows(b, width)
    y = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    if y.numel():
        block = min(1024, triton.next_power_of_2(width))
        grid = (a2.shape[0], triton.cdiv(width, block))
        _act_mul_kernel[grid](a2, b2, y, width, a2.stride(0), b2.stride(0), SILU=act == "silu", BLOCK=block)
    return y
