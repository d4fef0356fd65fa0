"""`chunk_kda(..., backend="fla")`: the same op computed by flash-linear-attention's Triton kernels, a speed and
accuracy baseline (the `fla` extra; docs/kernels.md, "The KDA ops").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.common import resolve_scale, validate_chunk_size, validate_kda_inputs
from hybrid_attention.ops.kda.value_heads import value_head_groups, value_head_view

INSTALL_HINT = 'pip install "hybrid-attention[fla]" (flash-linear-attention 0.6.0 and its fla-core)'


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
    use_beta_sigmoid: bool = False,
    return_chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Shapes and results as `chunk_kda` (q, k may have fewer heads than v): o [B, T, Hv, V] in v.dtype, final
    state [N, Hv, K, V] float32 or None, and with return_chunk_states the states of ops/kda/chunk_states.py.

    FLA supports chunk_size 32 or 64, K <= 256, and float16/bfloat16/float32 CUDA tensors.
    """
    name = "chunk_kda[fla]"
    heads = v.shape[2] if value_head_groups(q, k, v, name=name) > 1 else None
    qc, kc = (q, k) if heads is None else (value_head_view(q, heads), value_head_view(k, heads))
    validate_kda_inputs(qc, kc, v, g, beta, initial_state, cu_seqlens, name=name)
    validate_chunk_size(chunk_size, name="chunk_kda[fla]", allowed=(32, 64))
    fla_chunk_kda = load_fla_chunk_kda()
    if q.dtype == torch.float64:
        raise ValueError('chunk_kda: backend="fla" supports float16, bfloat16 and float32 inputs, got float64')
    if not q.is_cuda:
        raise ValueError(f'chunk_kda: backend="fla" needs CUDA tensors, got q on {q.device}')
    if q.shape[-1] > 256:
        raise ValueError(f'chunk_kda: backend="fla" supports K <= 256, got q of shape {tuple(q.shape)}')
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)
    )
    if return_chunk_states and needs_grad:
        raise ValueError(
            'chunk_kda: backend="fla" returns chunk states only when no gradient is needed (FLA computes them in '
            'inference mode); run under torch.no_grad(), or use backend="triton" or "torch"'
        )
    kwargs = dict(
        scale=resolve_scale(scale, q.shape[-1], name="chunk_kda[fla]"),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int64),
        chunk_size=chunk_size,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid),
    )
    if not return_chunk_states:
        o, final_state = fla_chunk_kda(q, k, v, g, beta, **kwargs)
        return o.to(v.dtype), final_state
    with torch.inference_mode():
        o, final_state, states = fla_chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **kwargs)
    # Clones made outside inference mode are ordinary tensors (inference tensors refuse later in-place use).
    final_state = None if final_state is None else final_state.clone()
    return o.to(v.dtype).clone(), final_state, states.to(torch.float32, copy=True)
