"""Rotary position embedding (RoPE, Su et al., arXiv 2104.09864) in the half-split layout of transformers' Llama:
channel i pairs with channel i + d/2 and turns by position * theta^(-2i/d). Equations in docs/math.md ("RoPE on the
shared key part"); the Gated MLA's `rope_theta` option applies it to q_s and k_s only."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Rotation angles [*positions.shape, dim // 2] (float64) of integer `positions` for `dim` channels.

    float64 because a float32 angle is off by position x 6e-8 radians, 2e-3 at 32K tokens; the table is small."""
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim
    inv_freq = theta**-exponents  # (dim // 2,)
    return positions.to(torch.float64)[..., None] * inv_freq


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles [*positions.shape, dim // 2] of integer `positions`, in `dtype`: one table
    for every tensor rotated at these positions."""
    angles = rope_angles(positions, dim, theta)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated by the table of `rope_cos_sin` (broadcast to [..., d/2]); the math in the table's dtype, the
    result in x's."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, d] or [B, T, H, d] (d even) rotated by its tokens' positions [B, T] or [1, T] (integers) -> the same
    shape and dtype; the rotation runs in float32 (float64 for float64 x)."""
    d = x.shape[-1]
    if x.dim() not in (3, 4):
        raise ValueError(f"apply_rope: x must be [B, T, d] or [B, T, H, d], got {tuple(x.shape)}")
    if d % 2:
        raise ValueError(f"apply_rope: the last dimension must be even, got {d}")
    if positions.dim() != 2 or positions.shape[1] != x.shape[1] or positions.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"apply_rope: positions must be [B or 1, T] for x {tuple(x.shape)}, got {positions.shape}")
    cos, sin = rope_cos_sin(positions, d, theta, torch.promote_types(x.dtype, torch.float32))  # (B, T, d/2)
    if x.dim() == 4:  # one angle per token, shared by every head
        cos, sin = cos[:, :, None], sin[:, :, None]
    return rotate(x, cos, sin)
