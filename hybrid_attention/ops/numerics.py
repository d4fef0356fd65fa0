"""Precision rules shared by every op and layer: math in float32 (float64 for float64 inputs), results in the input
dtype, so a bf16 model normalises and accumulates in float32 and a float64 model stays exact for gradcheck."""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(x: torch.Tensor | torch.dtype) -> torch.dtype:
    """float64 for float64 tensors (or dtypes), float32 for everything else."""
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def matmul_input_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul reads x in: under autocast, a float32 x is cast to the autocast dtype; else x.dtype."""
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension, in `compute_dtype(x)`, returned in x.dtype."""
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)
