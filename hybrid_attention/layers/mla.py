"""Gated Multi-head Latent Attention without positional encoding (NoPE), as in Kimi Linear / Kimi K3: equations in
docs/math.md ("Gated MLA (NoPE)"). Prefill runs the decompressed form on tensor cores, decode the absorbed form over
the latent cache rows [c ; k_s] (docs/inference.md, "Long prompts"); `rope_theta` adds RoPE on the shared key part
as a baseline to compare against, not the recipe."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.layers.documents import PackedDocuments, packed_documents
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.packed import PackedProjections, act_mul, linear, project
from hybrid_attention.layers.seqlens import SeqLens
from hybrid_attention.ops.backends import needs_grad, resolve, use_triton
from hybrid_attention.ops.mla.decode import mla_decode
from hybrid_attention.ops.mla.prefill import decompressed_break_even, mla_prefill
from hybrid_attention.ops.mla.prefix import PrefixReader, contiguous_prefix
from hybrid_attention.ops.mla.varlen import causal_varlen_attention
from hybrid_attention.ops.rope import rope_cos_sin, rotate

# Scores the PyTorch attention path may hold at once (B * query block * H * cache length): long chunked prefill on
# the CPU goes in query blocks so that memory stays bounded; the Triton path never materialises scores.
_TORCH_SCORE_BUDGET = 1 << 24


@dataclass
class MLACache:
    """Latent cache of one MLA layer: rows `[c ; k_s]` for every token seen so far, per sequence.

    rows: `[B, max_seq_len, d_c + d_s]`, preallocated; only `rows[b, :lengths[b]]` is meaningful, the rest may hold
        anything (NaN included) and is never read.
    seqlens: the tokens cached per sequence (`SeqLens`: int32 lengths on the rows' device and host counts), shared
        by every MLA layer of a model's cache (None: a record of its own). The caller advances it by the T tokens
        of a call before the call (`HybridLM.forward` does), so the layer writes rows at `lengths[b] - T + t` and
        attends up to `lengths[b]`, on the device: a decode step needs no host sync and stays valid inside a CUDA
        graph while the lengths advance.

    The layer reads a cache through `check_append`, `append`, `append_token`, `attend`, `prefix_reader`,
    `max_seq_len`, `dtype` and `seqlens` only, so a cache that lays its rows out differently (the serving engine's
    pages, `inference/paged_cache.py`) offers the same.
    """

    rows: torch.Tensor
    seqlens: SeqLens | None = None

    def __post_init__(self):
        B, N = self.rows.shape[:2]
        if self.seqlens is None:
            self.seqlens = SeqLens(B, N, device=self.rows.device)
        s = self.seqlens
        if s.batch_size != B or s.max_seq_len > N or s.device != self.rows.device:
            raise ValueError(
                f"MLACache: seqlens must count B={B} sequences of at most {N} tokens on {self.rows.device}, got "
                f"{s.batch_size} of at most {s.max_seq_len} on {s.device}"
            )

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

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def append(self, new_rows: torch.Tensor) -> None:
        """Write `new_rows` [B, T, d_c + d_s] at positions `lengths[b] - T + t`: the last T tokens the (already
        advanced) lengths count. The positions are computed on the device (a scatter), so sequences of different
        lengths append in one call and nothing syncs with the host."""
        B, T, width = new_rows.shape
        self.check_append(B, T, width)
        pos = self.seqlens.lengths.long()[:, None] - T + torch.arange(T, device=self.rows.device)  # (B, T)
        self.rows.scatter_(1, pos[:, :, None].expand(B, T, width), new_rows.to(self.rows.dtype))

    def append_token(self, kv: torch.Tensor, k_shared: torch.Tensor, norm: RMSNorm) -> None:
        """One token per sequence, fused (`ops.mla.append`): the row [norm(kv) ; k_shared] of kv [B, 1, d_c] and
        k_shared [B, 1, d_s], written at `lengths[b] - 1`."""
        from hybrid_attention.ops.mla.append import append_latent_row

        append_latent_row(kv, k_shared, norm.weight, norm.eps, self.rows, self.seqlens.lengths)

    def attend(self, q: torch.Tensor, seq_lens: torch.Tensor, *, value_dim: int, scale: float, backend: str):
        """`mla_decode` of absorbed queries q [B, Tq, H, D] over the first seq_lens[b] rows -> [B, Tq, H, value_dim]."""
        return mla_decode(q, self.rows, seq_lens, value_dim=value_dim, scale=scale, backend=backend)

    def prefix_reader(self) -> PrefixReader:
        """Tiles of the cached rows for the decompressed prefill (`ops.mla.prefix`): views, nothing copied."""
        return contiguous_prefix(self.rows)

    def check_append(self, batch_size: int, num_tokens: int, width: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(
                f"MLACache: batch size {batch_size} does not match the cache's batch size {self.batch_size}"
            )
        if width != self.rows.shape[-1]:
            raise ValueError(f"MLACache: row width {width} does not match the cache's row width {self.rows.shape[-1]}")
        if self.seqlens.shortest < num_tokens:
            raise ValueError(
                f"MLACache: {num_tokens} new tokens, but a sequence counts only {self.seqlens.shortest}; advance "
                f"cache.seqlens by the new tokens before the call (HybridLM.forward does)"
            )


def _fused_append_ok(x: torch.Tensor) -> bool:
    """The fused one-token cache append (`ops.mla.append`, no backward) takes x: the rule of
    `hybrid_attention.ops.backends` with no gradient needed."""
    return use_triton(x, needs_backward=torch.is_grad_enabled())


class GatedMLA(nn.Module):
    """Gated MLA (NoPE). x: [B, T, hidden_size] -> [B, T, hidden_size].

    Sizes: H = num_heads, d_c = kv_lora_rank, d_n = qk_nope_head_dim, d_s = qk_shared_head_dim,
    d_v = v_head_dim, d_q = q_lora_rank (None: a direct query projection). output_gate: the sigmoid gate
    `sigmoid(W_g x)` on the concatenated heads (False: no `g_proj`, the heads go straight to `W_o`). rope_theta:
    None (NoPE), or the base of a rotary embedding on the shared parts q_s and k_s (d_s even), at each token's
    position in its sequence (its document's, when packed).
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
        output_gate: bool = True,
        rope_theta: float | None = None,
    ):
        super().__init__()
        if not isinstance(output_gate, bool):
            raise ValueError(f"GatedMLA: output_gate must be a bool, got {output_gate!r}")
        if rope_theta is not None:
            if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 1:
                raise ValueError(f"GatedMLA: rope_theta must be None or a number > 1, got {rope_theta!r}")
            if qk_shared_head_dim < 2 or qk_shared_head_dim % 2:
                raise ValueError(
                    f"GatedMLA: RoPE rotates the shared key part in pairs of channels; qk_shared_head_dim must be "
                    f"even and >= 2, got {qk_shared_head_dim!r}"
                )
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
        self.output_gate = output_gate
        self.rope_theta = None if rope_theta is None else float(rope_theta)
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
        if output_gate:
            self.g_proj = nn.Linear(hidden_size, H * v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * v_head_dim, hidden_size, bias=False)

    @property
    def latent_dim(self) -> int:
        """Width of one cache row, d_c + d_s."""
        return self.kv_lora_rank + self.qk_shared_head_dim

    def empty_cache(
        self, batch_size: int, max_seq_len: int, device=None, dtype=None, seqlens: SeqLens | None = None
    ) -> MLACache:
        """A cache for `batch_size` sequences of up to `max_seq_len` tokens (rows zeroed), counted by `seqlens`
        (None: a new record of its own, at length 0)."""
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"GatedMLA.empty_cache: batch_size and max_seq_len must be >= 1, got {batch_size} and {max_seq_len}"
            )
        device = device if device is not None else self.kv_down.weight.device
        dtype = dtype if dtype is not None else self.kv_down.weight.dtype
        rows = torch.zeros(batch_size, max_seq_len, self.latent_dim, device=device, dtype=dtype)
        return MLACache(rows=rows, seqlens=seqlens)

    def packed_linears(self) -> list[nn.Linear]:
        """The bias-free projections of x, in the order `forward` unpacks them (see layers/packed.py)."""
        q_in = self.q_proj if self.q_lora_rank is None else self.q_down
        return [q_in, self.kv_down, self.k_shared] + ([self.g_proj] if self.output_gate else [])

    def _query(self, q_in: torch.Tensor, decode: PackedProjections | None = None) -> torch.Tensor:
        """The query projection (q_proj x, or q_down x with a query LoRA) [B, T, *] -> q: [B, T, H, d_n + d_s]."""
        q = q_in if self.q_lora_rank is None else linear(self.q_up, self.q_norm(q_in), decode)
        return q.view(*q_in.shape[:2], self.num_heads, self.qk_head_dim)

    def _latent_rows(self, kv: torch.Tensor, k_shared: torch.Tensor) -> torch.Tensor:
        """kv_down x [B, T, d_c], k_shared x [B, T, d_s] -> cache rows [c ; k_s]: [B, T, d_c + d_s]."""
        return torch.cat([self.kv_norm(kv), k_shared], dim=-1)

    def _prefill_attention(
        self, q: torch.Tensor, rows: torch.Tensor, docs: PackedDocuments | None = None
    ) -> torch.Tensor:
        """Decompressed path, queries and keys of equal length: q [B, T, H, d_n + d_s], rows [B, T, d_c + d_s]
        -> o [B, T, H, d_v]. `docs` (B == 1): attend only within each packed document."""
        B, T, H, _ = q.shape
        c, k_s = rows.split([self.kv_lora_rank, self.qk_shared_head_dim], dim=-1)
        k_n = self.k_up(c).view(B, T, H, self.qk_nope_head_dim)
        v = self.v_up(c).view(B, T, H, self.v_head_dim)
        k = torch.cat([k_n, k_s.unsqueeze(2).expand(B, T, H, self.qk_shared_head_dim)], dim=-1)
        if docs is not None:
            o = causal_varlen_attention(q[0], k[0], v[0], docs.cu_seqlens, docs.max_len, scale=self.scale)
            return o.unsqueeze(0)
        # is_causal is top-left aligned: correct here only because query and key lengths are equal.
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )  # (B, H, T, d_v)
        return o.transpose(1, 2)

    def _decompressed_chunk(self, seqlens: SeqLens, T: int) -> bool:
        """Whether a chunk of T > 1 tokens (already counted by `seqlens`) takes the decompressed form: every sequence
        holds the same number of tokens, and the cache held none before the chunk or T reaches the break-even."""
        if seqlens.shortest != seqlens.longest:
            return False
        sizes = (self.num_heads, self.kv_lora_rank, self.qk_shared_head_dim, self.qk_nope_head_dim, self.v_head_dim)
        return seqlens.longest == T or T >= decompressed_break_even(*sizes)

    def _chunk_attention(self, q: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """Decompressed form over the cache: q [B, T, H, d_n + d_s], the last T tokens of sequences that all hold L
        -> o [B, T, H, d_v]. The chunk's rows are read back from the cache, so that prefill and decode see the same
        (possibly rounded) values; the prefix is read tile by tile (`ops.mla.mla_prefill`)."""
        T, L = q.shape[1], cache.seqlens.longest
        H, d_c = self.num_heads, self.kv_lora_rank
        w_uk = self.k_up.weight.view(H, self.qk_nope_head_dim, d_c)
        w_uv = self.v_up.weight.view(H, self.v_head_dim, d_c)
        prefix = cache.prefix_reader()  # a contiguous or a paged cache
        return mla_prefill(q, prefix(L - T, L), w_uk, w_uv, scale=self.scale, prefix=prefix, prefix_len=L - T)

    def _absorbed_attention(self, q: torch.Tensor, cache: MLACache, seq_lens: torch.Tensor) -> torch.Tensor:
        """Absorbed path over the cache: q [B, T, H, d_n + d_s] (the last T tokens of each sequence), the cache's
        rows of which sequence b has seq_lens[b] (int32 [B], device) valid -> o [B, T, H, d_v].

        Reads k_up / v_up weights only; never builds per-head keys or values. Attention is `cache.attend`, i.e.
        `mla_decode` (its "auto": the Triton flash-decoding kernel on CUDA, the PyTorch path elsewhere or when
        gradients are needed); on the PyTorch path queries go in blocks so that a long chunk never materialises more
        than about `_TORCH_SCORE_BUDGET` scores, and each block sees only the keys up to its last query (bottom-right
        causal, exact)."""
        B, T, H, _ = q.shape
        d_n, d_c, d_v = self.qk_nope_head_dim, self.kv_lora_rank, self.v_head_dim
        q_n, q_s = q.split([d_n, self.qk_shared_head_dim], dim=-1)
        w_uk = self.k_up.weight.view(H, d_n, d_c)
        w_uv = self.v_up.weight.view(H, d_v, d_c)
        q_lat = torch.einsum("bthn,hnc->bthc", q_n, w_uk)  # (B, T, H, d_c): W_UK,h^T q_n,h
        # The kernel takes one dtype: queries follow the cache (the cache is what is large).
        q_abs = torch.cat([q_lat, q_s], dim=-1).to(cache.dtype)  # (B, T, H, d_c + d_s)
        backend = resolve("auto", q_abs, name="GatedMLA", needs_backward=needs_grad(q_abs))
        if backend == "triton":
            block = T  # the kernel keeps only the output: one launch covers the whole chunk
        else:
            block = max(1, _TORCH_SCORE_BUDGET // (B * H * cache.max_seq_len))
        outs = []
        for start in range(0, T, block):
            end = min(T, start + block)
            # Queries [start, end) are the last (end - start) tokens of a sequence seq_lens - (T - end) long.
            lens = seq_lens if end == T else seq_lens - (T - end)
            outs.append(cache.attend(q_abs[:, start:end], lens, value_dim=d_c, scale=self.scale, backend=backend))
        o_lat = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(q.dtype)  # (B, T, H, d_c)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # (B, T, H, d_v): W_UV,h o_lat,h

    def forward(
        self,
        x: torch.Tensor,
        cache: MLACache | None = None,
        *,
        decode: PackedProjections | None = None,
        cu_seqlens: torch.Tensor | PackedDocuments | None = None,
    ) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]. `decode`: a decode step's packed projections (layers/packed.py),
        which then compute the products. `cu_seqlens` (int [N + 1], B == 1; or a `PackedDocuments`): N documents
        packed along T, each attending only to itself (`ops.mla.varlen`); no cache, or one that takes packed
        documents (each document's rows then go to its sequence).

        With `cache` (whose lengths the caller has advanced by these T tokens), the new rows are written in place
        as the last T of each sequence and the queries attend to everything cached so far. A multi-token call on
        sequences of one length takes the decompressed form when it is the cheaper one (`_decompressed_chunk`);
        anything else (one-token decoding, short chunks, sequences of different lengths) takes the absorbed path with
        a bottom-right causal mask over each sequence's length. One-token calls always take the absorbed path, so a
        captured decode step does not depend on the host counts.
        """
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedMLA: expected x of shape [B, T, {self.hidden_size}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        if T == 0:
            raise ValueError("GatedMLA: x has no tokens (T = 0)")
        docs = packed_documents("GatedMLA", cu_seqlens, x, cache)
        # Documents that each start a sequence of `cache` (inference/packed_prefill.py): attention as without a
        # cache, each document's rows written to its sequence.
        packed = docs is not None and cache is not None
        if cache is not None and not packed:
            # Validate before any write so a bad call leaves the cache untouched.
            cache.check_append(B, T, self.latent_dim)

        q_in, kv, k_shared, *gate = project(self, x, decode)
        g_in = gate[0] if gate else None
        q = self._query(q_in, decode)  # (B, T, H, d_n + d_s)
        if self.rope_theta is not None:
            q, k_shared = self._rotate(q, k_shared, self._positions(x, None if packed else cache, docs))
        if cache is not None and not packed and T == 1 and _fused_append_ok(x):
            # Decoding on CUDA: norm + row + write in one kernel (same values as the eager append).
            cache.append_token(kv, k_shared, self.kv_norm)
            o = self._absorbed_attention(q, cache, cache.seqlens.lengths)
            return self._output(g_in, o, decode)
        new_rows = self._latent_rows(kv, k_shared)  # (B, T, d_c + d_s)
        if packed:
            cache.store(new_rows, docs)
        if cache is None or packed:
            o = self._prefill_attention(q, new_rows, docs)
        elif T > 1 and self._decompressed_chunk(cache.seqlens, T):
            cache.append(new_rows)
            o = self._chunk_attention(q, cache)
        else:
            cache.append(new_rows)
            o = self._absorbed_attention(q, cache, cache.seqlens.lengths)
        return self._output(g_in, o, decode)

    def _positions(self, x: torch.Tensor, cache: MLACache | None, docs: PackedDocuments | None) -> torch.Tensor:
        """Each token's position in its sequence, [B, T] or [1, T]: after the cached ones (read on the device, so a
        captured decode step stays valid), in its packed document, or 0..T-1."""
        T = x.shape[1]
        if cache is not None:  # the lengths already count these T tokens
            return cache.seqlens.lengths.long()[:, None] - T + torch.arange(T, device=x.device)
        if docs is not None:
            return docs.positions
        return torch.arange(T, device=x.device)[None]

    def _rotate(self, q: torch.Tensor, k_shared: torch.Tensor, positions: torch.Tensor):
        """RoPE on the shared parts: q [B, T, H, d_n + d_s], k_shared [B, T, d_s] -> the same, q_s and k_s rotated
        (`ops.rope.apply_rope`, with one cos/sin table for both)."""
        work = torch.promote_types(q.dtype, torch.float32)
        cos, sin = rope_cos_sin(positions, self.qk_shared_head_dim, self.rope_theta, work)  # (B, T, d_s / 2)
        q_n, q_s = q.split([self.qk_nope_head_dim, self.qk_shared_head_dim], dim=-1)
        q = torch.cat([q_n, rotate(q_s, cos[:, :, None], sin[:, :, None])], dim=-1)  # one angle for every head
        return q, rotate(k_shared, cos, sin)

    def _output(
        self, g_in: torch.Tensor | None, o: torch.Tensor, decode: PackedProjections | None = None
    ) -> torch.Tensor:
        """The gate projection W_g x [B, T, H*d_v] (None without the output gate), per-head outputs o [B, T, H, d_v]
        -> W_o (sigmoid(W_g x) * concat_h o_h), or W_o concat_h o_h."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.num_heads * self.v_head_dim)
        if g_in is None:
            return linear(self.o_proj, o, decode)
        return linear(self.o_proj, act_mul(g_in, o, "sigmoid", decode), decode)  # (B, T, H*d_v) before W_o

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
            f"qk_shared={self.qk_shared_head_dim}, v={self.v_head_dim}, q_lora_rank={self.q_lora_rank}, "
            f"output_gate={self.output_gate}" + ("" if self.rope_theta is None else f", rope_theta={self.rope_theta:g}")
        )
