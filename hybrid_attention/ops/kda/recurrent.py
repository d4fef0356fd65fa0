"""`recurrent_kda`: the ground truth, one token at a time (naive.py), with q and k shared by groups of value heads."""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.naive import naive_recurrent_kda
from hybrid_attention.ops.kda.value_heads import repeat_qk_heads, value_head_groups


def recurrent_kda(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time: the ground truth (naive.py), with q and k shared by groups of value heads.

    Args and results as `chunk_kda` without its backend options: q, k [B, T, Hqk, K]; v [B, T, Hv, V]; g
    [B, T, Hv, K]; beta [B, T, Hv]; initial_state [N, Hv, K, V] -> o [B, T, Hv, V], final state [N, Hv, K, V].
    """
    q, k = repeat_qk_heads(q, k, value_head_groups(q, k, v, name="recurrent_kda"))
    return naive_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
