"""The bounded KDA decay gate (MATH.md, "KDA recurrence"; Kimi Linear report, safe gate with lower bound -5).

    g = lower_bound * sigmoid(exp(A_log_h) * (z + dt_bias_hc))

`g` is the per-channel natural-log decay fed to the KDA ops. Since sigmoid is in (0, 1), g lies in
(lower_bound, 0); in float32 it stays strictly inside for |exp(A_log) (z + dt_bias)| below about 15 and
reaches the closed bounds only where sigmoid rounds to 0 or 1. The bound is what the chunkwise kernels
rely on: a 16-token sub-chunk then decays by at most e^(16 * 5) = e^80, inside float32 range.
"""

from __future__ import annotations

import math

import torch

from hybrid_attention.ops.kda.common import compute_dtype


def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Per-channel log decay from the raw decay logits.

    Args:
        z: [..., H, K] raw decay logits (the layer views its [B, T, H*K] projection as [B, T, H, K]).
        A_log: [H] per-head log rate (zeros at init).
        dt_bias: [H*K] per-channel bias, viewed as [H, K].
        lower_bound: the most negative decay per step (< 0).
    Returns:
        g: [..., H, K], float32 (float64 when z is float64), in [lower_bound, 0].
    Computed in float32/float64 whatever the input dtype, so bf16 logits do not coarsen the decay.
    """
    if not isinstance(lower_bound, (int, float)) or not math.isfinite(lower_bound) or lower_bound >= 0:
        raise ValueError(f"kda_gate: lower_bound must be a finite number < 0, got {lower_bound!r}")
    if z.dim() < 2:
        raise ValueError(f"kda_gate: z must be [..., H, K], got shape {tuple(z.shape)}")
    H, K = z.shape[-2:]
    if tuple(A_log.shape) != (H,):
        raise ValueError(
            f"kda_gate: A_log must be [H] = [{H}] for z of shape {tuple(z.shape)}, got {tuple(A_log.shape)}"
        )
    if tuple(dt_bias.shape) != (H * K,):
        raise ValueError(
            f"kda_gate: dt_bias must be [H*K] = [{H * K}] for z of shape {tuple(z.shape)}, got {tuple(dt_bias.shape)}"
        )
    for label, t in (("z", z), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not t.is_floating_point():
            raise ValueError(f"kda_gate: {label} must be a floating tensor, got {t.dtype}")
    dtype = compute_dtype(z)
    rate = A_log.to(dtype).exp().unsqueeze(-1)  # [H, 1]
    x = rate * (z.to(dtype) + dt_bias.to(dtype).view(H, K))  # [..., H, K]
    return lower_bound * torch.sigmoid(x)
