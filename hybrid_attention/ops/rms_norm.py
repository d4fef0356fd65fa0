"""RMSNorm with a learnable scale as one Triton kernel each way, differentiable, as torch custom ops (docs/math.md,
"RMSNorm"; docs/kernels.md, "RMSNorm").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybrid_attention.ops.numerics import compute_dtype
from hybrid_attention.ops.triton_support import (
    as_rows,
    compute_tl_dtype,
    eager_or_traced,
    interpreting,
    next_power_of_2,
    row_programs,
    split_scalar,
    triton_available,
    triton_runs_on,
)

MAX_WIDTH = 16384  # widest row a program holds in registers
ROW_ELEMENTS = 4096  # elements of x a program holds at once: rows per block = ROW_ELEMENTS // width, at most 16


def rows_per_block(width: int) -> int:
    return max(1, min(16, ROW_ELEMENTS // next_power_of_2(width)))


def _warps(width: int) -> int:
    return 8 if next_power_of_2(width) >= 4096 else 4


@triton.jit
def _rms_norm_fwd_kernel(
    x,
    w,
    y,
    rstd_out,
    n_rows,
    stride_x,
    eps_hi,
    eps_lo,
    D: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    CDT: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (d < D)[None, :]
    xf = tl.load(x + rows[:, None].to(tl.int64) * stride_x + d[None, :], mask=ok, other=0.0).to(CDT)
    eps = tl.cast(eps_hi, CDT) + tl.cast(eps_lo, CDT)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)
    wf = tl.load(w + d, mask=d < D, other=0.0).to(CDT)
    out = (xf * rstd[:, None]) * wf[None, :]
    tl.store(y + rows[:, None].to(tl.int64) * D + d[None, :], out.to(y.dtype.element_ty), mask=ok)
    tl.store(rstd_out + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    dy,
    x,
    w,
    rstd_in,
    dx,
    dw_part,
    n_rows,
    rows_per_program,
    stride_dy,
    stride_x,
    D: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    CDT: tl.constexpr,
):
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    d_ok = d < D
    wf = tl.load(w + d, mask=d_ok, other=0.0).to(CDT)
    dw_acc = tl.zeros([BD], CDT)
    first = pid * rows_per_program
    for start in range(first, first + rows_per_program, BR):
        rows = start + tl.arange(0, BR)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & d_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        xf = tl.load(x + r64 * stride_x + d[None, :], mask=ok, other=0.0).to(CDT)
        g = tl.load(dy + r64 * stride_dy + d[None, :], mask=ok, other=0.0).to(CDT)
        rstd = tl.load(rstd_in + rows, mask=row_ok, other=0.0).to(CDT)
        xh = xf * rstd[:, None]
        gw = g * wf[None, :]
        dxf = rstd[:, None] * (gw - xh * (tl.sum(gw * xh, 1) / D)[:, None])
        tl.store(dx + r64 * D + d[None, :], dxf.to(dx.dtype.element_ty), mask=ok)
        dw_acc += tl.sum(g * xh, 0)
    tl.store(dw_part + pid.to(tl.int64) * D + d, dw_acc, mask=d_ok)


def _forward(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(y [..., D] in `dtype`, rstd [...] in the compute dtype)."""
    D = x.shape[-1]
    x2 = as_rows(x, D)
    n = x2.shape[0]
    y = torch.empty(x.shape, device=x.device, dtype=dtype)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=compute_dtype(x))
    if n:
        br = rows_per_block(D)
        _rms_norm_fwd_kernel[(triton.cdiv(n, br),)](
            x2,
            weight,
            y,
            rstd,
            n,
            x2.stride(0),
            *split_scalar(eps),
            D=D,
            BD=next_power_of_2(D),
            BR=br,
            CDT=compute_tl_dtype(x.dtype),
            num_warps=_warps(D),
        )
    return y, rstd


def _backward_kernels(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx [..., D] in x.dtype, dw [D] in weight.dtype)."""
    D = x.shape[-1]
    x2, dy2 = as_rows(x, D), as_rows(dy, D)
    n = x2.shape[0]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if n == 0:
        return dx, torch.zeros_like(weight)
    br = rows_per_block(D)
    programs = row_programs(triton.cdiv(n, br), x.device)  # backward programs walk many rows: few dw partials
    rows_per_program = triton.cdiv(triton.cdiv(n, programs), br) * br
    programs = triton.cdiv(n, rows_per_program)
    dw_part = torch.empty(programs, D, device=x.device, dtype=rstd.dtype)
    _rms_norm_bwd_kernel[(programs,)](
        dy2,
        x2,
        weight,
        rstd,
        dx,
        dw_part,
        n,
        rows_per_program,
        dy2.stride(0),
        x2.stride(0),
        D=D,
        BD=next_power_of_2(D),
        BR=br,
        CDT=compute_tl_dtype(x.dtype),
        num_warps=_warps(D),
    )
    return dx, dw_part.sum(0).to(weight.dtype)


@torch.library.custom_op("hybrid_attention::rms_norm_fwd", mutates_args=())
def _fwd_op(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(y [..., D] in `dtype`, rstd [...] in the compute dtype)."""
    return _forward(x, weight, eps, dtype)


@_fwd_op.register_fake
def _(x, weight, eps, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[:-1], dtype=compute_dtype(x))


@torch.library.custom_op("hybrid_attention::rms_norm_bwd", mutates_args=())
def _bwd_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx [..., D] in x.dtype, dw [D] in weight.dtype)."""
    return _backward_kernels(dy, x, weight, rstd)


@_bwd_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


_fwd_call = eager_or_traced(_fwd_op, _forward)
_bwd_call = eager_or_traced(_bwd_op, _backward_kernels)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, dtype):
        y, rstd = _fwd_call(x, weight, eps, dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw = _bwd_call(dy, *ctx.saved_tensors)
        return dx, dw, None, None


def rms_norm_fused_supported(x: Tensor) -> bool:
    """The kernels take x [..., D]: a Triton dtype on CUDA or under the interpreter (there float64 too, for
    tests), and D <= MAX_WIDTH."""
    if not triton_available() or x.dim() == 0 or not 1 <= x.shape[-1] <= MAX_WIDTH:
        return False
    return triton_runs_on(x) or (x.dtype == torch.float64 and x.device.type == "cpu" and interpreting())


def rms_norm_fused(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype | None = None) -> Tensor:
    """x [..., D] (each row with unit stride along D), weight [D] -> RMSNorm(x) * weight in `dtype` (default
    x.dtype), as `ops.numerics.rms_norm(x, weight, eps).to(dtype)` computes it, differentiable in x and weight (the
    backward keeps x and 1/rms per row; its dx is in x.dtype)."""
    if not rms_norm_fused_supported(x):
        raise ValueError(
            f"rms_norm_fused: needs triton and a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1) of float16, "
            f"bfloat16 or float32 (float64 under the interpreter) with 1 <= D <= {MAX_WIDTH}; got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}; use ops.numerics.rms_norm"
        )
    if weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(
            f"rms_norm_fused: weight must be [{x.shape[-1]}] on {x.device}, got {tuple(weight.shape)} on "
            f"{weight.device}"
        )
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"rms_norm_fused: dtype must be a floating dtype or None, got {dtype}")
    dtype = x.dtype if dtype is None else dtype
    return _RMSNormFn.apply(x, weight, float(eps), dtype)
