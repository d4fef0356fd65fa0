"""The KDA output norm, RMSNorm(x) * w * sigmoid(gate) per head, as one Triton kernel each way (docs/math.md, "Gated
output norm"; docs/kernels.md, "The gated output norm").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per program


@triton.jit
def _load_rows(ptr, rows, d, n_rows, D: tl.constexpr):
    ok = (rows < n_rows)[:, None] & (d < D)[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * D + d[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _norm_rows(x, w, rows, d, n_rows, eps, D: tl.constexpr, DT: tl.constexpr):
    """(rstd, w, x * rstd) of BR rows, float32; x is rounded to DT first so a float32 input (the decode
    step's recurrence output) is normalised as the eager layer does after its cast."""
    xf = _load_rows(x, rows, d, n_rows, D).to(DT).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / D + tl.cast(eps, tl.float32))  # fp32 also when inductor passes fp64
    wf = tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)
    return rstd, wf, xf * rstd[:, None]


@triton.jit
def _gated_norm_fwd_kernel(x, gate, w, y, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    dt = y.dtype.element_ty
    _, wf, xh = _norm_rows(x, w, rows, d, n_rows, eps, D, dt)
    y1 = (xh * wf[None, :]).to(dt).to(tl.float32)
    out = y1 * tl.sigmoid(_load_rows(gate, rows, d, n_rows, D))
    ok = (rows < n_rows)[:, None] & (d < D)[None, :]
    tl.store(y + rows[:, None].to(tl.int64) * D + d[None, :], out.to(dt), mask=ok)


@triton.jit
def _gated_norm_bwd_kernel(
    x, gate, w, dy, dx, dgate, dw_part, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    dt = x.dtype.element_ty
    rstd, wf, xh = _norm_rows(x, w, rows, d, n_rows, eps, D, dt)
    s = tl.sigmoid(_load_rows(gate, rows, d, n_rows, D))
    g = _load_rows(dy, rows, d, n_rows, D)
    dg = g * (xh * wf[None, :]).to(dt).to(tl.float32) * s * (1.0 - s)
    dy1 = g * s
    dxh = dy1 * wf[None, :]
    dxf = rstd[:, None] * (dxh - xh * (tl.sum(dxh * xh, 1) / D)[:, None])
    ok = (rows < n_rows)[:, None] & (d < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + d[None, :]
    tl.store(dx + offs, dxf.to(dt), mask=ok)
    tl.store(dgate + offs, dg.to(dgate.dtype.element_ty), mask=ok)
    tl.store(dw_part + tl.program_id(0).to(tl.int64) * D + d, tl.sum(dy1 * xh, 0), mask=d < D)


def gated_norm_forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype):
    """The forward kernel alone (no autograd): x, gate contiguous with rows of D = weight.numel() values, the same
    number of rows; returns y shaped like gate in `dtype` (x is rounded to `dtype` first)."""
    D = weight.numel()
    n_rows = gate.numel() // D
    y = torch.empty(gate.shape, device=gate.device, dtype=dtype)
    grid = (triton.cdiv(n_rows, ROWS),)
    BD = triton.next_power_of_2(D)
    _gated_norm_fwd_kernel[grid](x, gate, weight, y, n_rows, float(eps), D=D, BD=BD, BR=ROWS, num_warps=4)
    return y


class _GatedNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        y = gated_norm_forward(x, gate, weight, eps, x.dtype)
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        D = x.shape[-1]
        n_rows = x.numel() // D
        grid = (triton.cdiv(n_rows, ROWS),)
        dx, dgate = torch.empty_like(x), torch.empty_like(gate)
        dw_part = torch.empty(grid[0], D, device=x.device, dtype=torch.float32)
        _gated_norm_bwd_kernel[grid](
            x,
            gate,
            weight,
            dy.contiguous(),
            dx,
            dgate,
            dw_part,
            n_rows,
            ctx.eps,
            D=D,
            BD=triton.next_power_of_2(D),
            BR=ROWS,
            num_warps=4,
        )
        return dx, dgate, dw_part.sum(0).to(weight.dtype), None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., D] (same shape; fp16 / bf16 / fp32 on CUDA or the Triton interpreter), weight [D]
    -> RMSNorm(x) * weight * sigmoid(gate) in x.dtype, differentiable in all three (as `GatedRMSNorm`)."""
    D = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (D,):
        raise ValueError(
            f"gated_rms_norm: gate must have x's shape {tuple(x.shape)} and weight [{D}], "
            f"got {tuple(gate.shape)} and {tuple(weight.shape)}"
        )
    return _GatedNormFn.apply(x.contiguous(), gate.contiguous(), weight, float(eps))
