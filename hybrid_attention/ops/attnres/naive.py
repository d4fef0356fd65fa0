"""Readable reference for Attention Residuals and Block AttnRes's two phases, the spec the kernels are tested against
(docs/math.md, "Attention Residuals"; arXiv 2603.15031).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from hybrid_attention.ops.numerics import compute_dtype, rms_norm


def _stack(sources: torch.Tensor | Sequence[torch.Tensor], name: str) -> torch.Tensor:
    """A sequence of [B, T, D] tensors or a stacked [S, B, T, D] tensor -> [S, B, T, D]."""
    if isinstance(sources, torch.Tensor):
        if sources.ndim < 2 or sources.shape[0] == 0:
            raise ValueError(f"{name}: expected stacked sources [S, B, T, D] with S >= 1, got {tuple(sources.shape)}")
        return sources
    if len(sources) == 0:
        raise ValueError(f"{name}: sources is empty; need at least one [B, T, D] tensor")
    shapes = {tuple(s.shape) for s in sources}
    if len(shapes) != 1:
        raise ValueError(f"{name}: all sources must have the same shape, got {sorted(shapes)}")
    # Mixed dtypes (a float32 embedding beside bf16 sublayer outputs under autocast) promote, as `h + f(h)` would.
    dtype = functools.reduce(torch.promote_types, [s.dtype for s in sources])
    return torch.stack([s.to(dtype) for s in sources])


def _check_params(name: str, D: int, query: torch.Tensor, key_weight: torch.Tensor | None, queries_ok: bool) -> None:
    ok_query = query.ndim == 1 or (queries_ok and query.ndim == 2)
    if not ok_query or query.shape[-1] != D:
        expected = f"[{D}] or [Q, {D}]" if queries_ok else f"[{D}]"
        raise ValueError(f"{name}: query must have shape {expected}, got {tuple(query.shape)}")
    if key_weight is not None and tuple(key_weight.shape) != (D,):
        raise ValueError(f"{name}: key_weight must have shape [{D}], got {tuple(key_weight.shape)}")


def _logits(v: torch.Tensor, query: torch.Tensor, key_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """v: [..., D] (compute dtype), query [D] or [Q, D] -> w . (gamma * v / rms(v)): [...] or [Q, ...]."""
    keys = rms_norm(v, None, eps)
    w = query.to(v.dtype)
    if key_weight is not None:
        # (w * gamma) . v_hat == w . (gamma * v_hat): fold gamma into the query, one vector instead of a tensor.
        w = w * key_weight.to(v.dtype)
    if w.ndim == 1:
        return keys @ w
    return torch.einsum("qd,...d->q...", w, keys)


def naive_attn_res_weights(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    key_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Depth-softmax probabilities. sources [S, B, T, D] or S x [B, T, D]; query, key_weight [D]
    (key_weight None = ones) -> p [S, B, T] in float32 (float64 for float64 sources), summing to one over S."""
    v = _stack(sources, "naive_attn_res_weights")
    _check_params("naive_attn_res_weights", v.shape[-1], query, key_weight, queries_ok=False)
    return torch.softmax(_logits(v.to(compute_dtype(v)), query, key_weight, eps), dim=0)


def naive_attn_res(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    key_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Full AttnRes mixture. sources [S, B, T, D] or S x [B, T, D]; query, key_weight [D] -> h [B, T, D]
    in the sources' dtype."""
    v = _stack(sources, "naive_attn_res")
    _check_params("naive_attn_res", v.shape[-1], query, key_weight, queries_ok=False)
    vf = v.to(compute_dtype(v))
    p = torch.softmax(_logits(vf, query, key_weight, eps), dim=0)  # (S, B, T)
    return (p.unsqueeze(-1) * vf).sum(0).to(v.dtype)


def naive_attn_res_partial(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    key_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of Block AttnRes: attention over the completed blocks only.

    Args:
        sources: the completed block sums, [S, B, T, D] or S x [B, T, D] (S >= 1: b_0 is the embedding).
        query: one pseudo-query [D], or the Q pseudo-queries of a block's sublayers [Q, D] at once.
        key_weight: [D] key-norm weight shared by all queries, or None (ones). With several sublayers whose
            key-norm weights differ, pass `query * key_weight` per row and key_weight None: only the product counts.

    Returns:
        out: normalised mixture [B, T, D] (or [Q, B, T, D]) and lse: log-sum-exp of the logits [B, T]
        (or [Q, B, T]), both in float32 (float64 for float64 sources) so that the merge stays exact.
    """
    v = _stack(sources, "naive_attn_res_partial")
    _check_params("naive_attn_res_partial", v.shape[-1], query, key_weight, queries_ok=True)
    vf = v.to(compute_dtype(v))
    logits = _logits(vf, query, key_weight, eps)  # (S, B, T) or (Q, S, B, T)
    src_dim = 0 if query.ndim == 1 else 1
    lse = torch.logsumexp(logits, dim=src_dim)
    p = torch.exp(logits - lse.unsqueeze(src_dim))
    out = (p.unsqueeze(-1) * vf).sum(src_dim)
    return out, lse


def naive_attn_res_merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    key_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Phase 2 of Block AttnRes: fold the running partial sum into a phase-1 result, exactly.

    With s the logit of `partial`, the full softmax over [completed blocks ; partial] gives
    h = (e^lse out + e^s partial) / (e^lse + e^s) = out + sigmoid(s - lse) * (partial - out).

    Args:
        out: [B, T, D] and lse: [B, T], phase-1 results for this query (one row of a batched phase 1).
        partial: [B, T, D] the partial sum of the current block.
        query, key_weight: [D], the same as in phase 1.

    Returns:
        h [B, T, D] in `partial.dtype`, equal to `naive_attn_res(completed + [partial], query, key_weight, eps)`.
    """
    D = partial.shape[-1]
    _check_params("naive_attn_res_merge", D, query, key_weight, queries_ok=False)
    if out.shape != partial.shape or lse.shape != partial.shape[:-1]:
        raise ValueError(
            f"naive_attn_res_merge: expected out {tuple(partial.shape)} and lse {tuple(partial.shape[:-1])} to match "
            f"partial {tuple(partial.shape)}, got out {tuple(out.shape)} and lse {tuple(lse.shape)}"
        )
    dtype = compute_dtype(partial)
    pf = partial.to(dtype)
    s = _logits(pf, query, key_weight, eps)  # (B, T)
    weight = torch.sigmoid(s - lse.to(dtype)).unsqueeze(-1)  # share of the partial sum
    of = out.to(dtype)
    return (of + weight * (pf - of)).to(partial.dtype)
