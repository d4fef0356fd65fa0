"""Gated Multi-head Latent Attention without positional encoding (NoPE), as in Kimi Linear / Kimi K3.

Equations in MATH.md ("Gated MLA"); background in notes/gated-mla.md. Per token the layer computes a latent
`c = RMSNorm(W_DKV x)` [d_c] and one shared key part `k_s = W_KS x` [d_s]. Head h has key `[W_UK,h c ; k_s]`,
value `W_UV,h c` and query `[q_n,h ; q_s,h]`; causal softmax with scale `(d_n + d_s) ** -0.5`; the heads are
concatenated, gated elementwise by `sigmoid(W_g x)` (the "G1" output gate) and projected by `W_o`.

Two paths compute the same function:
- prefill (no cache, or an empty one): decompress per-head K and V and call SDPA, which is cheaper in FLOPs;
- decode / chunked prefill on a non-empty cache: weight absorption. W_UK is folded into the query and W_UV is
  applied after attending in latent space, so the only per-token data read is the cache row `[c ; k_s]`
  (d_c + d_s numbers for all heads together) and no per-head key or value is ever built.
There is no rotary embedding anywhere, so cache rows do not depend on their position.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.ops.mla.naive import absorbed_attention


@dataclass
class MLACache:
    """Latent cache of one MLA layer: rows `[c ; k_s]` for every token seen so far.

    rows: `[B, max_seq_len, d_c + d_s]`, preallocated; only `rows[:, :length]` is meaningful.
    length: number of tokens filled. Writes go in place into `rows` (slice assignment), never reallocate.
    """

    rows: torch.Tensor
    length: int = 0

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.rows.shape[1]

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token (per sequence) for this layer: `(d_c + d_s) * element_size`."""
        return self.rows.shape[-1] * self.rows.element_size()

    def append(self, new_rows: torch.Tensor) -> torch.Tensor:
        """Write `new_rows` [B, T, d_c + d_s] after the filled part; return the filled view [B, length, d_c + d_s]."""
        B, T, width = new_rows.shape
        self._check_append(B, T, width)
        self.rows[:, self.length : self.length + T] = new_rows
        self.length += T
        return self.rows[:, : self.length]

    def _check_append(self, batch_size: int, num_tokens: int, width: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(
                f"MLACache: batch size {batch_size} does not match the cache's batch size {self.batch_size}"
            )
        if width != self.rows.shape[-1]:
            raise ValueError(f"MLACache: row width {width} does not match the cache's row width {self.rows.shape[-1]}")
        if self.length + num_tokens > self.max_seq_len:
            raise ValueError(
                f"MLACache: capacity is {self.max_seq_len} tokens, but appending {num_tokens} to the {self.length} "
                f"already cached needs {self.length + num_tokens}"
            )


class GatedMLA(nn.Module):
    """Gated MLA (NoPE). x: [B, T, hidden_size] -> [B, T, hidden_size].

    Sizes: H = num_heads, d_c = kv_lora_rank, d_n = qk_nope_head_dim, d_s = qk_shared_head_dim,
    d_v = v_head_dim, d_q = q_lora_rank (None: a direct query projection).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_shared_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        sizes = dict(
            hidden_size=hidden_size,
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_shared_head_dim=qk_shared_head_dim,
            v_head_dim=v_head_dim,
        )
        if q_lora_rank is not None:
            sizes["q_lora_rank"] = q_lora_rank
        for name, value in sizes.items():
            # d_s = 0 is allowed: no shared key part, the cache row is c alone and keys equal values.
            low = 0 if name == "qk_shared_head_dim" else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"GatedMLA: {name} must be an int >= {low}, got {value!r}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_shared_head_dim = qk_shared_head_dim
        self.v_head_dim = v_head_dim
        self.q_lora_rank = q_lora_rank
        self.qk_head_dim = qk_nope_head_dim + qk_shared_head_dim
        # The per-head QK dot product has d_n + d_s terms, whichever path computes it.
        self.scale = self.qk_head_dim**-0.5

        H = num_heads
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, H * self.qk_head_dim, bias=False)
        else:
            self.q_down = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_up = nn.Linear(q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_down = nn.Linear(hidden_size, kv_lora_rank, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=norm_eps)
        with warnings.catch_warnings():  # d_s = 0 gives an empty weight, whose init torch warns is a no-op
            warnings.simplefilter("ignore", UserWarning)
            self.k_shared = nn.Linear(hidden_size, qk_shared_head_dim, bias=False)
        self.k_up = nn.Linear(kv_lora_rank, H * qk_nope_head_dim, bias=False)
        self.v_up = nn.Linear(kv_lora_rank, H * v_head_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, H * v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * v_head_dim, hidden_size, bias=False)

    @property
    def latent_dim(self) -> int:
        """Width of one cache row, d_c + d_s."""
        return self.kv_lora_rank + self.qk_shared_head_dim

    def empty_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None) -> MLACache:
        """A cache for `batch_size` sequences of up to `max_seq_len` tokens (rows zeroed, length 0)."""
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"GatedMLA.empty_cache: batch_size and max_seq_len must be >= 1, got {batch_size} and {max_seq_len}"
            )
        device = device if device is not None else self.kv_down.weight.device
        dtype = dtype if dtype is not None else self.kv_down.weight.dtype
        return MLACache(rows=torch.zeros(batch_size, max_seq_len, self.latent_dim, device=device, dtype=dtype))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> q: [B, T, H, d_n + d_s]."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_up(self.q_norm(self.q_down(x)))
        return q.view(*x.shape[:2], self.num_heads, self.qk_head_dim)

    def _latent_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> cache rows [c ; k_s]: [B, T, d_c + d_s]."""
        return torch.cat([self.kv_norm(self.kv_down(x)), self.k_shared(x)], dim=-1)

    def _prefill_attention(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Decompressed path, queries and keys of equal length: q [B, T, H, d_n + d_s], rows [B, T, d_c + d_s]
        -> o [B, T, H, d_v]."""
        B, T, H, _ = q.shape
        c, k_s = rows.split([self.kv_lora_rank, self.qk_shared_head_dim], dim=-1)
        k_n = self.k_up(c).view(B, T, H, self.qk_nope_head_dim)
        v = self.v_up(c).view(B, T, H, self.v_head_dim)
        k = torch.cat([k_n, k_s.unsqueeze(2).expand(B, T, H, self.qk_shared_head_dim)], dim=-1)
        # is_causal is top-left aligned: correct here only because query and key lengths are equal.
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )  # (B, H, T, d_v)
        return o.transpose(1, 2)

    def _absorbed_attention(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Absorbed path over the cache: q [B, T, H, d_n + d_s] (the last T of Tk tokens), rows [B, Tk, d_c + d_s]
        -> o [B, T, H, d_v]. Reads k_up / v_up weights only; never builds per-head keys or values."""
        H, d_n, d_c, d_v = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank, self.v_head_dim
        q_n, q_s = q.split([d_n, self.qk_shared_head_dim], dim=-1)
        w_uk = self.k_up.weight.view(H, d_n, d_c)
        w_uv = self.v_up.weight.view(H, d_v, d_c)
        q_lat = torch.einsum("bthn,hnc->bthc", q_n, w_uk)  # (B, T, H, d_c): W_UK,h^T q_n,h
        q_abs = torch.cat([q_lat, q_s], dim=-1)  # (B, T, H, d_c + d_s)
        o_lat = absorbed_attention(q_abs, rows.to(q.dtype), value_dim=d_c, scale=self.scale, causal=True)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # (B, T, H, d_v): W_UV,h o_lat,h

    def forward(self, x: torch.Tensor, cache: MLACache | None = None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden].

        With `cache`, the new rows are appended in place (cache.length grows by T) and the queries attend to
        everything cached so far. An empty cache takes the decompressed prefill path; a non-empty one (one-token
        decoding or chunked prefill) takes the absorbed path with a bottom-right causal mask.
        """
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedMLA: expected x of shape [B, T, {self.hidden_size}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        if T == 0:
            raise ValueError("GatedMLA: x has no tokens (T = 0)")
        if cache is not None:
            # Validate before any write so a bad call leaves the cache untouched.
            cache._check_append(B, T, self.latent_dim)

        q = self._query(x)  # (B, T, H, d_n + d_s)
        new_rows = self._latent_rows(x)  # (B, T, d_c + d_s)
        if cache is None:
            o = self._prefill_attention(q, new_rows)
        elif cache.length == 0:
            # Read the rows back from the cache so prefill and decode see the same (possibly rounded) values.
            o = self._prefill_attention(q, cache.append(new_rows).to(q.dtype))
        else:
            o = self._absorbed_attention(q, cache.append(new_rows))
        gate = torch.sigmoid(self.g_proj(x))  # (B, T, H*d_v)
        return self.o_proj(gate * o.reshape(B, T, self.num_heads * self.v_head_dim))

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
            f"qk_shared={self.qk_shared_head_dim}, v={self.v_head_dim}, q_lora_rank={self.q_lora_rank}"
        )
