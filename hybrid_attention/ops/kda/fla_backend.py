"""`chunk_kda(..., backend="fla")`: the same op computed by flash-linear-attention's Triton kernels.

Used as a speed and accuracy baseline (benchmarks, GPU tests). Needs the optional extra
`pip install "hybrid-attention[fla]"` (fla-core==0.6.0) and CUDA tensors. Only arguments with the same
meaning as ours are passed: a pre-computed `g` (no in-kernel gate, no in-kernel l2norm or beta sigmoid),
our scale, the float32 initial state, `output_final_state`, `cu_seqlens` as int64 and `chunk_size`.
FLA's default `safe_gate=False` path is exact for any g <= 0, like ours.
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.common import resolve_scale, validate_chunk_size, validate_kda_inputs

INSTALL_HINT = 'pip install "hybrid-attention[fla]" (fla-core==0.6.0)'


def load_fla_chunk_kda():
    """Import FLA's `chunk_kda`, or raise ValueError with the install command."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as exc:  # ImportError, or an incompatible install failing at import time
        raise ValueError(
            f'chunk_kda: backend="fla" needs flash-linear-attention: {INSTALL_HINT}; import failed: {exc!r}'
        ) from exc
    return fla_chunk_kda


def chunk_kda_fla(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shapes and results as `chunk_kda`: o [B, T, H, V] in v.dtype, final state [N, H, K, V] float32 or None.

    FLA supports chunk_size 32 or 64, K <= 256, and float16/bfloat16/float32 CUDA tensors.
    """
    validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, name="chunk_kda[fla]")
    validate_chunk_size(chunk_size, name="chunk_kda[fla]", allowed=(32, 64))
    fla_chunk_kda = load_fla_chunk_kda()
    if q.dtype == torch.float64:
        raise ValueError('chunk_kda: backend="fla" supports float16, bfloat16 and float32 inputs, got float64')
    if not q.is_cuda:
        raise ValueError(f'chunk_kda: backend="fla" needs CUDA tensors, got q on {q.device}')
    if q.shape[-1] > 256:
        raise ValueError(f'chunk_kda: backend="fla" supports K <= 256, got q of shape {tuple(q.shape)}')
    o, final_state = fla_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=resolve_scale(scale, q.shape[-1], name="chunk_kda[fla]"),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int64),
        chunk_size=chunk_size,
    )
    return o.to(v.dtype), final_state
