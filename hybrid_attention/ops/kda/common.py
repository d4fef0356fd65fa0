"""Input checks and small helpers shared by every KDA backend (torch reference, Triton, FLA); the shape and dtype
rules are in docs/kernels.md, "The KDA ops".
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

from hybrid_attention.ops.numerics import compute_dtype

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in float32 (float64), returned in x.dtype.

    The same eps as the Triton kernels' in-kernel normalisation, so every backend normalises alike."""
    xf = x.to(compute_dtype(x))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def validate_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    *,
    name: str,
) -> int:
    """Check the KDA op inputs; raise ValueError naming the offending tensor and what was expected.

    `name` prefixes every message (e.g. "chunk_kda"). Returns N, the number of sequences (= rows of the state).
    The values of `cu_seqlens` are checked too (one host sync), except while a CUDA graph is being captured.
    """
    for label, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
    for label, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} must be a torch.Tensor or None, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if T == 0 or H == 0 or K == 0:
        raise ValueError(f"{name}: q must have T, H, K >= 1, got shape {_shape(q)}")
    if _shape(k) != _shape(q):
        raise ValueError(f"{name}: k must have the shape of q {_shape(q)} = [B, T, H, K], got {_shape(k)}")
    if v.dim() != 4 or _shape(v)[:3] != (B, T, H) or v.shape[3] == 0:
        raise ValueError(f"{name}: v must be [B, T, H, V] = [{B}, {T}, {H}, V] with V >= 1, got shape {_shape(v)}")
    if _shape(g) != _shape(q):
        raise ValueError(f"{name}: g must have the shape of q {_shape(q)} = [B, T, H, K], got {_shape(g)}")
    if _shape(beta) != (B, T, H):
        raise ValueError(f"{name}: beta must be [B, T, H] = {(B, T, H)}, got shape {_shape(beta)}")
    V = v.shape[3]

    # Dtypes.
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for label, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: q, k and v must share one dtype, got q {q.dtype} and {label} {t.dtype}")
    for label, t in (("g", g), ("beta", beta)):
        if t.dtype not in (q.dtype, torch.float32):
            raise ValueError(f"{name}: {label} must be {q.dtype} (the dtype of q) or float32, got {t.dtype}")

    # Devices.
    tensors = [("k", k), ("v", v), ("g", g), ("beta", beta)]
    if initial_state is not None:
        tensors.append(("initial_state", initial_state))
    if cu_seqlens is not None:
        tensors.append(("cu_seqlens", cu_seqlens))
    for label, t in tensors:
        if t.device != q.device:
            raise ValueError(f"{name}: {label} is on {t.device} but q is on {q.device}; all inputs must share a device")

    # Varlen packing.
    if cu_seqlens is None:
        N = B
    else:
        if cu_seqlens.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"{name}: cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {_shape(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"{name}: cu_seqlens packs sequences along T and needs B == 1, got q of shape {_shape(q)}")
        N = cu_seqlens.shape[0] - 1
        capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            bounds = cu_seqlens.tolist()
            if bounds[0] != 0 or bounds[-1] != T:
                raise ValueError(f"{name}: cu_seqlens must start at 0 and end at T = {T}, got {bounds}")
            if any(b < a for a, b in pairwise(bounds)):
                raise ValueError(f"{name}: cu_seqlens must be non-decreasing, got {bounds}")

    # Initial state.
    if initial_state is not None:
        if _shape(initial_state) != (N, H, K, V):
            raise ValueError(
                f"{name}: initial_state must be [N, H, K, V] = {(N, H, K, V)} "
                f"({'N = len(cu_seqlens) - 1' if cu_seqlens is not None else 'N = B'}), got {_shape(initial_state)}"
            )
        allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if initial_state.dtype not in allowed:
            raise ValueError(
                f"{name}: initial_state must be {' or '.join(str(d) for d in allowed)} for {q.dtype} inputs, "
                f"got {initial_state.dtype}"
            )
    return N


def resolve_scale(scale, K: int, *, name: str) -> float:
    """The output scale: K ** -0.5 when None, else a finite number > 0 (anything else is a ValueError)."""
    if scale is None:
        return K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: scale must be a finite number > 0 (or None for K ** -0.5), got {scale!r}")
    return float(scale)


def check_values(g: torch.Tensor | None, beta: torch.Tensor, *, name: str) -> None:
    """The value rules of the math: a decay g <= 0 (None: g holds gate logits, not checked) and beta in [0, 1].

    One fused reduction and one host sync; skipped while compiling or capturing a CUDA graph. NaN passes (it makes the
    outputs from its token on NaN, as the recurrence does); g = -inf is a valid decay (it erases the state)."""
    if torch.compiler.is_compiling() or (beta.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad_beta = ((beta < 0) | (beta > 1)).any()
    bad_g = (g > 0).any() if g is not None else torch.zeros((), dtype=torch.bool, device=beta.device)
    flags = torch.stack([bad_g, bad_beta]).tolist()
    if flags[0]:
        raise ValueError(f"{name}: g is a log decay and must be <= 0 everywhere, got a maximum of {g.max().item()}")
    if flags[1]:
        raise ValueError(f"{name}: beta must lie in [0, 1], got values in [{beta.min().item()}, {beta.max().item()}]")


def validate_chunk_size(chunk_size: int, *, name: str, allowed: tuple[int, ...] = (16, 32, 64)) -> None:
    """Chunk sizes are powers of two the kernels tile with; anything else is a ValueError."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in allowed:
        raise ValueError(f"{name}: chunk_size must be one of {allowed}, got {chunk_size!r}")


def sequence_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """Python (start, end) pairs of the sequences packed by `cu_seqlens` ([N + 1] -> N pairs)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    return list(pairwise(bounds))
