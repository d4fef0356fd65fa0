"""Chunked MLA prefill in the decompressed form (docs/math.md, "Chunked prefill in the decompressed form"): a chunk of
C queries attends causally to its own keys and fully to a cached prefix of P tokens, with per-head keys
K_h = [W_UK,h c ; k_s] and values V_h = W_UV,h c up-projected tile by tile (the prefix is never decompressed whole),
each tile through one flash-attention call that returns the log-sum-exp, the partial outputs merged by their LSEs.
`naive_prefill.naive_mla_prefill` is the specification."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_attention.ops.mla.lse_attention import attention_with_lse
from hybrid_attention.ops.mla.prefix import PrefixReader
from hybrid_attention.ops.numerics import compute_dtype

# Bytes of decompressed keys and values one prefix tile may hold (B * tile * H * (d_n + d_s + d_v) numbers), small
# next to a long cache and far below 2 GiB, the most one attention call's tensor should span; and the fewest keys a
# tile gets, the cuDNN length multiple. At batch 1 the bytes allow 64K keys, where a merge costs about 1 / tile of
# the tile's attention time.
TILE_BYTES = 512 << 20
MIN_TILE_TOKENS = 1 << 10


def up_projection_weights(w_uk: torch.Tensor, w_uv: torch.Tensor, d_s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w_uk [H, d_n, d_c], w_uv [H, d_v, d_c] -> (w_k [H * (d_n + d_s), d_c + d_s], w_v [H * d_v, d_c]) such that
    rows [c ; k_s] @ w_k.T = per-head keys [W_UK,h c ; k_s] and c @ w_v.T = per-head values W_UV,h c.

    The identity block copies k_s into every head inside the one product (exact: ones times k_s plus zeros), so the
    keys come out of a single GEMM already in the [.., H, d_n + d_s] layout, with no concatenation or broadcast copy.
    """
    H, d_n, d_c = w_uk.shape
    w_k = w_uk.new_zeros(H, d_n + d_s, d_c + d_s)
    w_k[:, :d_n, :d_c] = w_uk
    w_k[:, d_n:, d_c:] = torch.eye(d_s, dtype=w_uk.dtype, device=w_uk.device)
    return w_k.view(H * (d_n + d_s), d_c + d_s), w_uv.reshape(-1, d_c)


def decompressed_break_even(num_heads: int, d_c: int, d_s: int, d_n: int, d_v: int) -> int:
    """The chunk length from which attending to a cached prefix costs fewer FLOPs decompressed than absorbed.

    Per prefix token, decompressing costs the up-projection once per chunk, 2 H ((d_c + d_s)(d_n + d_s) + d_c d_v),
    plus 2 H (d_n + d_s + d_v) per query; the absorbed form costs 2 H (2 d_c + d_s) per query (docs/math.md). At
    k3-scaled sizes that is 242 tokens. A latent no wider than the heads (2 d_c <= d_n + d_v) never breaks even.
    """
    up = 2 * num_heads * ((d_c + d_s) * (d_n + d_s) + d_c * d_v)
    saved_per_query = 2 * num_heads * (2 * d_c - d_n - d_v)
    return -(-up // saved_per_query) if saved_per_query > 0 else 1 << 62


def default_tile_size(batch_size: int, num_heads: int, head_dims: int, itemsize: int) -> int:
    """Prefix tokens per tile: a power of two, what `TILE_BYTES` holds of decompressed keys and values (head_dims =
    d_n + d_s + d_v per head) for the whole batch, at least `MIN_TILE_TOKENS`. Tiles start at multiples of it, so
    with chunks of a power of two every tile but the last of each chunk is full and the calls repeat a few shapes."""
    tokens = TILE_BYTES // (batch_size * num_heads * head_dims * itemsize)
    return max(MIN_TILE_TOKENS, 1 << max(0, tokens.bit_length() - 1))


def merge_partial_(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the attention over more keys into a running result, exactly:

        lse' = log(e^acc_lse + e^lse),    acc' = e^(acc_lse - lse') acc + e^(lse - lse') o

    acc [B, T, H, Dv] and acc_lse [B, H, T] (float32 or float64) are updated in place; o [B, H, T, Dv], lse [B, H, T].
    """
    new_lse = torch.logaddexp(acc_lse, lse)
    acc.mul_(torch.exp(acc_lse - new_lse).transpose(1, 2).unsqueeze(-1))
    acc.addcmul_(o.transpose(1, 2), torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def mla_prefill(
    q: torch.Tensor,
    rows: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    prefix: PrefixReader | None = None,
    prefix_len: int = 0,
    tile_size: int | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of a prefill chunk over the cached prefix and itself, in the decompressed form.

    Args:
        q: [B, C, H, d_n + d_s] the chunk's queries [q_n,h ; q_s,h].
        rows: [B, C, d_c + d_s] the chunk's own latent rows [c ; k_s] (as stored in the cache).
        w_uk: [H, d_n, d_c] and w_uv: [H, d_v, d_c], the up-projections W_UK,h and W_UV,h.
        scale: softmax scale, (d_n + d_s) ** -0.5 for Gated MLA.
        prefix: reader of the cached rows before the chunk (`ops.mla.prefix`), the same prefix_len tokens for every
            sequence; None when prefix_len is 0.
        tile_size: prefix tokens decompressed at a time (None: `default_tile_size`).
        kernel: the attention kernel (`lse_attention.KERNELS`; "auto" picks per shape and device).

    Returns:
        [B, C, H, d_v] in q.dtype: query i (at position prefix_len + i) attends to every prefix token and to chunk
        tokens j <= i. Partial results are merged in float32 (float64 for float64).
    """
    B, C, H, d_qk = _check(q, rows, w_uk, w_uv, prefix, prefix_len, tile_size)
    d_n, d_c = w_uk.shape[1:]
    d_v = w_uv.shape[1]
    w_k, w_v = up_projection_weights(w_uk.to(q.dtype), w_uv.to(q.dtype), d_qk - d_n)

    def keys_values(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, d_c + d_s] -> K [B, H, S, d_n + d_s], V [B, H, S, d_v] (views of [B, S, H, *] products)."""
        S = latent.shape[1]
        if latent.shape != (B, S, rows.shape[2]):
            raise ValueError(
                f"mla_prefill: the prefix reader gave a tile {tuple(latent.shape)}; expected [{B}, S, {rows.shape[2]}]"
            )
        latent = latent.to(q.dtype)
        k = F.linear(latent, w_k).view(B, S, H, d_qk)
        v = F.linear(latent[..., :d_c], w_v).view(B, S, H, d_v)
        return k.transpose(1, 2), v.transpose(1, 2)

    qh = q.transpose(1, 2)  # (B, H, C, d_qk), a view
    o, lse = attention_with_lse(qh, *keys_values(rows), scale=scale, causal=True, kernel=kernel)
    if prefix_len == 0:
        return o.transpose(1, 2)
    acc = o.transpose(1, 2).to(compute_dtype(q))  # (B, C, H, d_v): the running result, float32 or float64
    acc_lse = lse.to(acc.dtype)
    tile = tile_size or default_tile_size(B, H, d_qk + d_v, q.element_size())
    for start in range(0, prefix_len, tile):
        stop = min(prefix_len, start + tile)
        o, lse = attention_with_lse(qh, *keys_values(prefix(start, stop)), scale=scale, kernel=kernel)
        merge_partial_(acc, acc_lse, o, lse)
    return acc.to(q.dtype)


def _check(q, rows, w_uk, w_uv, prefix, prefix_len, tile_size) -> tuple[int, int, int, int]:
    """Raise ValueError naming what is wrong with `mla_prefill`'s arguments; return B, C, H, d_n + d_s."""
    if q.ndim != 4 or rows.ndim != 3 or w_uk.ndim != 3 or w_uv.ndim != 3:
        raise ValueError(
            f"mla_prefill: expected q [B, C, H, d_n + d_s], rows [B, C, d_c + d_s], w_uk [H, d_n, d_c], w_uv "
            f"[H, d_v, d_c], got {tuple(q.shape)}, {tuple(rows.shape)}, {tuple(w_uk.shape)}, {tuple(w_uv.shape)}"
        )
    B, C, H, d_qk = q.shape
    _, d_n, d_c = w_uk.shape
    if C == 0 or rows.shape[:2] != (B, C) or w_uk.shape[0] != H or w_uv.shape[::2] != (H, d_c) or d_qk < d_n:
        raise ValueError(
            f"mla_prefill: shapes do not agree: q {tuple(q.shape)}, rows {tuple(rows.shape)}, w_uk "
            f"{tuple(w_uk.shape)}, w_uv {tuple(w_uv.shape)}; expected rows [B, C, ...], {H} heads and d_c = {d_c}"
        )
    if rows.shape[2] != d_c + d_qk - d_n:
        raise ValueError(
            f"mla_prefill: rows are {rows.shape[2]} wide; expected d_c + d_s = {d_c} + {d_qk - d_n} (the query's "
            f"shared part)"
        )
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"mla_prefill: prefix_len must be an int >= 0, got {prefix_len!r}")
    if prefix_len > 0 and prefix is None:
        raise ValueError(f"mla_prefill: prefix_len={prefix_len} but no prefix reader")
    if tile_size is not None and (isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1):
        raise ValueError(f"mla_prefill: tile_size must be None or an int >= 1, got {tile_size!r}")
    return B, C, H, d_qk
