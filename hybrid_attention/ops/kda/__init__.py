"""Kimi Delta Attention ops: the recurrent ground truth, the chunkwise op with backend dispatch, and the gate.

    o, S = recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None)
    o, S = chunk_kda(q, k, v, g, beta, ..., chunk_size=64, backend="auto")
    g = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)

Backends of `chunk_kda`: "torch" (readable reference, naive.py), "triton" (our kernels, triton_chunk.py),
"fla" (flash-linear-attention 0.6.0, optional extra), "auto" (see `resolve_backend`).
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.common import validate_kda_inputs
from hybrid_attention.ops.kda.gate import kda_gate
from hybrid_attention.ops.kda.naive import chunk_kda_torch, recurrent_kda

__all__ = ["BACKENDS", "chunk_kda", "kda_gate", "recurrent_kda", "resolve_backend", "validate_kda_inputs"]

BACKENDS = ("auto", "torch", "triton", "fla")


def resolve_backend(backend: str, q: torch.Tensor | None = None) -> str:
    """Map a backend name to the one that runs; "auto" picks for the device of `q`. Unknown names raise."""
    if backend not in BACKENDS:
        raise ValueError(f"chunk_kda: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "auto":
        return "torch"  # switch to `"triton" if q is not None and q.is_cuda else "torch"` once the kernels land
    return backend


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA; every backend computes exactly `recurrent_kda`.

    Args:
        q, k: [B, T, H, K] (L2-normalised by the caller).  v: [B, T, H, V].
        g: [B, T, H, K] natural-log decay (e.g. from `kda_gate`).  beta: [B, T, H].
        scale: defaults to K ** -0.5.
        initial_state: [N, H, K, V] float32 (or float64 with float64 inputs); zeros when None.
        output_final_state: return the state after the last token.
        cu_seqlens: int [N + 1]; packs N sequences along T of a batch of one (B == 1).
        chunk_size: 16, 32 or 64 (the FLA backend takes 32 or 64).
        backend: "auto", "torch", "triton" or "fla".
    Returns:
        o [B, T, H, V] in v.dtype, and the final state [N, H, K, V] (float32/float64) or None.
    """
    backend = resolve_backend(backend, q)
    kwargs = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    if backend == "torch":
        return chunk_kda_torch(q, k, v, g, beta, **kwargs)
    if backend == "fla":
        from hybrid_attention.ops.kda.fla_backend import chunk_kda_fla

        return chunk_kda_fla(q, k, v, g, beta, **kwargs)
    try:  # backend == "triton"; imported lazily so that the reference works without triton
        from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton
    except ImportError as exc:
        raise ValueError(f'chunk_kda: backend="triton" is unavailable: {exc!r}') from exc
    return chunk_kda_triton(q, k, v, g, beta, **kwargs)
