"""RMSNorm and the sigmoid-gated RMSNorm used on the KDA output.

Both normalise in float32 (float64 for float64 inputs) and return the input dtype: `torch.nn.RMSNorm`
normalises in the input dtype, which loses precision for bf16 activations.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_attention.backends import use_triton
from hybrid_attention.ops.numerics import compute_dtype, rms_norm

__all__ = ["GatedRMSNorm", "RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learnable scale (ones at init)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]."""
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """`RMSNorm(x) * sigmoid(gate)`: the KDA output norm, applied per head (dim = head_dim). On CUDA it runs as one
    Triton kernel each way (`ops.gated_norm`, the same roundings; the rule of `hybrid_attention.backends`); the eager
    code here is its reference."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x.dtype."""
        if gate.shape == x.shape and use_triton(x):
            from hybrid_attention.ops.gated_norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.weight, self.eps)
        y = rms_norm(x, self.weight, self.eps)
        return (y.to(compute_dtype(x)) * torch.sigmoid(gate.to(compute_dtype(x)))).to(x.dtype)
