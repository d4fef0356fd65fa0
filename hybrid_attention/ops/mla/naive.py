"""Readable reference for attention over the MLA latent cache with weight absorption: multi-query attention with the
heads folded into the query axis, the spec the Triton decode kernel is tested against (docs/math.md, "Absorbed decode").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.numerics import compute_dtype


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


def naive_absorbed_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    causal: bool = True,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-query attention over latent cache rows, with W_UK already absorbed into the query.

    Args:
        q: `[B, Tq, H, d_c + d_s]` absorbed queries `[W_UK,h^T q_n,h ; q_s,h]`.
        rows: `[B, Tk, d_c + d_s]` cache rows `[c ; k_s]`, shared by all heads (keys).
            The values are `rows[..., :value_dim]`.
        value_dim: d_c, the width of the latent part that serves as the value.
        scale: softmax scale; for MLA it must be `(d_n + d_s) ** -0.5`, not `q.shape[-1] ** -0.5`.
        causal: query i sits at position `L - Tq + i` (bottom-right aligned, L the sequence's length) and sees keys
            `j <= L - Tq + i`.
        seq_lens: int `[B]` or None (every sequence holds all Tk rows). Rows past `seq_lens[b]` are never read (they
            may hold garbage or NaN: a preallocated cache); lengths are clamped into [0, Tk], and a query that sees
            no key returns zeros.

    Returns:
        `[B, Tq, H, value_dim]` in `q.dtype`: the per-head output in latent space (apply W_UV,h after).
        Scores and softmax are computed in float32 (float64 for float64 inputs).
    """
    if q.ndim != 4 or rows.ndim != 3:
        raise ValueError(
            f"naive_absorbed_attention: expected q [B, Tq, H, D] and rows [B, Tk, D], "
            f"got q {tuple(q.shape)} and rows {tuple(rows.shape)}"
        )
    B, Tq, H, D = q.shape
    Tk = rows.shape[1]
    if rows.shape[0] != B or rows.shape[2] != D:
        raise ValueError(
            f"naive_absorbed_attention: rows {tuple(rows.shape)} do not match q {tuple(q.shape)}; "
            f"expected rows [{B}, Tk, {D}]"
        )
    if not 0 < value_dim <= D:
        raise ValueError(f"naive_absorbed_attention: value_dim must be in [1, {D}], got {value_dim}")
    if Tk == 0:
        raise ValueError("naive_absorbed_attention: rows is empty (Tk = 0); there is nothing to attend to")
    if causal and Tq > Tk:
        raise ValueError(f"naive_absorbed_attention: causal attention needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")

    dtype = compute_dtype(q)
    keys = rows.to(dtype)  # (B, Tk, D)
    positions = torch.arange(Tk, device=q.device)
    visible = torch.ones(B, Tq, Tk, dtype=torch.bool, device=q.device)
    if seq_lens is None:
        lens = torch.full((B,), Tk, device=q.device)
    else:
        lens = seq_lens.long().clamp(0, Tk)
        valid = positions[None, :] < lens[:, None]  # (B, Tk)
        # Zero the rows past each length before any product: garbage or NaN there must not leak in as 0 * NaN.
        keys = torch.where(valid[:, :, None], keys, 0.0)
        visible = visible & valid[:, None, :]
    if causal:
        last = lens[:, None] - Tq + torch.arange(Tq, device=q.device)[None, :]  # (B, Tq): last key each query sees
        visible = visible & (positions[None, None, :] <= last[:, :, None])

    # Fold the heads into the query axis: one shared key row per token means one matmul for all heads.
    qf = q.to(dtype).reshape(B, Tq * H, D)
    scores = (torch.bmm(qf, keys.transpose(1, 2)) * scale).view(B, Tq, H, Tk)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    # Softmax written out so that a query seeing no key gives zeros, not NaN.
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    probs = (weights / torch.where(total > 0, total, torch.ones_like(total))).view(B, Tq * H, Tk)
    out = torch.bmm(probs, keys[..., :value_dim])  # (B, Tq*H, value_dim)
    return out.view(B, Tq, H, value_dim).to(q.dtype)
