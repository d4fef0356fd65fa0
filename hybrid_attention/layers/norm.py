"""RMSNorm and the sigmoid-gated RMSNorm used on the KDA output, normalised in float32 and returned in the input dtype;
one Triton kernel each way on CUDA, the eager code here their reference (docs/kernels.md, "RMSNorm").
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_attention.ops.backends import use_triton
from hybrid_attention.ops.numerics import compute_dtype, matmul_input_dtype, rms_norm

__all__ = ["GatedRMSNorm", "RMSNorm", "rms_norm"]


class _RMSNormFn(torch.autograd.Function):
    """`rms_norm` (the same forward ops) with a backward that keeps x and the per-row 1/rms only: autograd on the
    eager ops would also keep float32 copies of x (for a bf16 x) and of the normalised x, 2-3x the bytes.

    dx = rstd (dy w - xh mean(dy w xh)),   dw = sum_rows dy xh,   xh = x rstd   (in compute_dtype(x))."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.to(compute_dtype(x))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xh = x.to(rstd.dtype) * rstd
        dyf = dy.to(rstd.dtype)
        dyw = dyf * weight.to(rstd.dtype)
        dx = rstd * (dyw - xh * (dyw * xh).mean(-1, keepdim=True)) if ctx.needs_input_grad[0] else None
        dw = (dyf * xh).reshape(-1, xh.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return (
            None if dx is None else dx.to(x.dtype),
            None if dw is None else dw.to(weight.dtype),
            None,
        )


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learnable scale (ones at init). On CUDA: `ops.rms_norm.rms_norm_fused`
    (the same roundings, one kernel each way), which under autocast returns a float32 input's result in the autocast
    dtype, rounded as the matmul that reads it would round it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim] in x.dtype (in the autocast dtype on CUDA under autocast; `rms_norm`; the
        backward keeps only x and 1/rms per row)."""
        if use_triton(x):
            from hybrid_attention.ops.rms_norm import rms_norm_fused, rms_norm_fused_supported  # imports triton

            if rms_norm_fused_supported(x):
                # What reads a norm's output is a matmul: written in its input dtype, the same numbers, one pass less.
                return rms_norm_fused(x, self.weight, self.eps, matmul_input_dtype(x))
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """`RMSNorm(x) * sigmoid(gate)`: the KDA output norm, applied per head (dim = head_dim). On CUDA it runs as one
    Triton kernel each way (`ops.gated_norm`, the same roundings; the rule of `ops.backends`); the eager
    code here is its reference."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x.dtype."""
        if gate.shape == x.shape and use_triton(x):
            from hybrid_attention.ops.gated_norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.weight, self.eps)
        y = rms_norm(x, self.weight, self.eps)
        return (y.to(compute_dtype(x)) * torch.sigmoid(gate.to(compute_dtype(x)))).to(x.dtype)
