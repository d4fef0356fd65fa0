"""RMSNorm and the sigmoid-gated RMSNorm used on the KDA output.

Both normalise in float32 (float64 for float64 inputs) and return the input dtype: `torch.nn.RMSNorm`
normalises in the input dtype, which loses precision for bf16 activations.
"""

from __future__ import annotations

import torch
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension, in float32 or float64."""
    xf = x.to(_compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


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
    """`RMSNorm(x) * sigmoid(gate)`: the KDA output norm, applied per head (dim = head_dim)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x.dtype."""
        y = rms_norm(x, self.weight, self.eps)
        return (y.to(_compute_dtype(x)) * torch.sigmoid(gate.to(_compute_dtype(x)))).to(x.dtype)
