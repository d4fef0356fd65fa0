"""Readable reference for attention over the MLA latent cache with weight absorption (MATH.md, "Gated MLA").

With NoPE, head h scores cached token j as `scale * q'_h . [c_j ; k_s,j]` where the absorbed query is
`q'_h = [W_UK,h^T q_n,h ; q_s,h]`, and attends to the values `c_j` (the first d_c columns of the same row).
That is multi-query attention with a single key/value row per token shared by every head, so the heads
are folded into the query axis and handled by one matmul: nothing is ever stored or built per head.

This file is the specification the Triton decode kernel is tested against; it favours clarity over speed.
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def bottom_right_causal_mask(Tq: int, Tk: int, device=None) -> torch.Tensor:
    """Causal mask for `Tq` new queries that are the last `Tq` of `Tk` keys.

    Query i sits at position `Tk - Tq + i` and may attend to keys `j <= Tk - Tq + i`.
    Returns bool `[Tq, Tk]`, True = may attend. (SDPA's `is_causal` is top-left aligned instead,
    which is only the same when Tq == Tk.)
    """
    if Tq < 0 or Tk < 0 or Tq > Tk:
        raise ValueError(f"bottom_right_causal_mask: need 0 <= Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    pos_q = torch.arange(Tq, device=device).unsqueeze(1) + (Tk - Tq)  # (Tq, 1)
    pos_k = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    return pos_k <= pos_q


def absorbed_attention(
    q: torch.Tensor, rows: torch.Tensor, *, value_dim: int, scale: float, causal: bool = True
) -> torch.Tensor:
    """Multi-query attention over latent cache rows, with W_UK already absorbed into the query.

    Args:
        q: `[B, Tq, H, d_c + d_s]` absorbed queries `[W_UK,h^T q_n,h ; q_s,h]`.
        rows: `[B, Tk, d_c + d_s]` cache rows `[c ; k_s]`, shared by all heads (keys).
            The values are `rows[..., :value_dim]`.
        value_dim: d_c, the width of the latent part that serves as the value.
        scale: softmax scale; for MLA it must be `(d_n + d_s) ** -0.5`, not `q.shape[-1] ** -0.5`.
        causal: query i sits at position `Tk - Tq + i` (bottom-right aligned) and sees keys `j <= Tk - Tq + i`.

    Returns:
        `[B, Tq, H, value_dim]` in `q.dtype`: the per-head output in latent space (apply W_UV,h after).
        Scores and softmax are computed in float32 (float64 for float64 inputs).
    """
    if q.ndim != 4 or rows.ndim != 3:
        raise ValueError(
            f"absorbed_attention: expected q [B, Tq, H, D] and rows [B, Tk, D], "
            f"got q {tuple(q.shape)} and rows {tuple(rows.shape)}"
        )
    B, Tq, H, D = q.shape
    Tk = rows.shape[1]
    if rows.shape[0] != B or rows.shape[2] != D:
        raise ValueError(
            f"absorbed_attention: rows {tuple(rows.shape)} do not match q {tuple(q.shape)}; "
            f"expected rows [{B}, Tk, {D}]"
        )
    if not 0 < value_dim <= D:
        raise ValueError(f"absorbed_attention: value_dim must be in [1, {D}], got {value_dim}")
    if Tk == 0:
        raise ValueError("absorbed_attention: rows is empty (Tk = 0); there is nothing to attend to")
    if causal and Tq > Tk:
        raise ValueError(f"absorbed_attention: causal attention needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")

    dtype = _compute_dtype(q)
    keys = rows.to(dtype)  # (B, Tk, D)
    # Fold the heads into the query axis: one shared key row per token means one matmul for all heads.
    qf = q.to(dtype).reshape(B, Tq * H, D)
    scores = torch.bmm(qf, keys.transpose(1, 2)) * scale  # (B, Tq*H, Tk)
    scores = scores.view(B, Tq, H, Tk)
    if causal:
        mask = bottom_right_causal_mask(Tq, Tk, device=q.device)  # (Tq, Tk)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, Tq * H, Tk)
    out = torch.bmm(probs, keys[..., :value_dim])  # (B, Tq*H, value_dim)
    return out.view(B, Tq, H, value_dim).to(q.dtype)
