"""The serving engine's cache: MLA latent rows in fixed-size pages (one pool per MLA layer, a page table per slot),
KDA states and conv tails in slots, and `PagedBatch`, the cache `HybridLM.forward` reads for a run of slots
(docs/inference.md, "Serving"). Page 0 is scratch: padding rows write there and no real sequence reads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybrid_attention.cache import LayerCaches, layer_tensors
from hybrid_attention.device import to_device
from hybrid_attention.layers.kda import KDACache
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.seqlens import SeqLens
from hybrid_attention.ops.mla.paged import paged_mla_decode, write_paged_rows
from hybrid_attention.ops.mla.prefix import PrefixReader, paged_prefix


class PagedLatentCache:
    """One MLA layer's rows for a batch of slots, read and written through their page-table rows.

    pool: [1 + num_pages, page_size, D] the layer's pages; page_table: int32 [B, max_pages] (a view of the cache's
    table); seqlens: the batch's length record, shared by its MLA layers.
    """

    def __init__(self, pool: torch.Tensor, page_table: torch.Tensor, seqlens: SeqLens):
        self.pool, self.page_table, self.seqlens = pool, page_table, seqlens

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.page_table.shape[1] * self.pool.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    def check_append(self, batch_size: int, num_tokens: int, width: int) -> None:
        if batch_size != self.batch_size or width != self.pool.shape[-1]:
            raise ValueError(
                f"PagedLatentCache: rows [{batch_size}, {num_tokens}, {width}] do not fit a batch of "
                f"{self.batch_size} with rows of {self.pool.shape[-1]}"
            )
        if self.seqlens.shortest < num_tokens:
            raise ValueError(
                f"PagedLatentCache: {num_tokens} new tokens, but a sequence counts only {self.seqlens.shortest}; "
                "advance the lengths by the new tokens before the call (HybridLM.forward does)"
            )

    def append(self, new_rows: torch.Tensor) -> None:
        """new_rows [B, T, D] as the last T tokens the (already advanced) lengths count."""
        self.check_append(*new_rows.shape)
        write_paged_rows(self.pool, self.page_table, self.seqlens.lengths, new_rows)

    def append_token(self, kv: torch.Tensor, k_shared: torch.Tensor, norm: RMSNorm) -> None:
        """One token per sequence, fused: [norm(kv) ; k_shared] written at lengths[b] - 1 (`ops.mla.append`)."""
        from hybrid_attention.ops.mla.append import append_latent_row

        append_latent_row(
            kv, k_shared, norm.weight, norm.eps, self.pool, self.seqlens.lengths, page_table=self.page_table
        )

    def attend(self, q: torch.Tensor, seq_lens: torch.Tensor, *, value_dim: int, scale: float, backend: str):
        """`paged_mla_decode` of absorbed queries q [B, Tq, H, D] -> [B, Tq, H, value_dim]."""
        return paged_mla_decode(
            q, self.pool, self.page_table, seq_lens, value_dim=value_dim, scale=scale, backend=backend
        )

    def prefix_reader(self) -> PrefixReader:
        """Tiles of the cached rows for the decompressed prefill, gathered page by page (`ops.mla.prefix`)."""
        return paged_prefix(self.pool, self.page_table)


class PagedBatch(LayerCaches):
    """What `HybridLM.forward` (and `DecodeStep`) read of a cache, for `count` consecutive slots of a `PagedCache`:
    `layers` (KDACache views or PagedLatentCache, per decoder layer) and the length record."""


class PagedCache:
    """Pages for the MLA rows and slots for the KDA states of up to `num_slots` sequences of `model` (page 0 is
    scratch); every tensor zeroed, on `device` in `dtype` (KDA states in float32)."""

    def __init__(
        self, model, *, num_pages: int, page_size: int, num_slots: int, max_context: int, device, dtype: torch.dtype
    ):
        if min(num_pages, page_size, num_slots, max_context) < 1:
            raise ValueError(
                f"PagedCache: num_pages={num_pages}, page_size={page_size}, num_slots={num_slots}, "
                f"max_context={max_context}; expected all >= 1"
            )
        self.page_size, self.num_pages, self.num_slots = page_size, num_pages, num_slots
        self.max_pages = math.ceil(max_context / page_size)
        self.device = torch.device(device)
        self.page_table = torch.zeros(num_slots, self.max_pages, dtype=torch.int32, device=self.device)
        self.layers: list[KDACache | torch.Tensor] = []
        for layer in model.layers:
            if layer.layer_type == "kda":
                self.layers.append(layer.mixer.empty_cache(num_slots, device=self.device, dtype=dtype))
            else:
                shape = (1 + num_pages, page_size, layer.mixer.latent_dim)
                self.layers.append(torch.zeros(shape, device=self.device, dtype=dtype))

    @staticmethod
    def page_bytes(model, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page: page_size rows in every MLA layer."""
        return page_size * model.cache_bytes_per_token(dtype)

    @staticmethod
    def slot_bytes(model, dtype: torch.dtype) -> int:
        """Bytes of one slot: a KDA state and conv tails in every KDA layer."""
        return model.state_bytes_per_sequence(dtype)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def batch(self, first: int, count: int) -> PagedBatch:
        """The cache of the sequences in slots first .. first + count - 1, lengths 0 until assigned."""
        if not (0 <= first and count >= 1 and first + count <= self.num_slots):
            raise ValueError(f"PagedCache.batch: slots [{first}, {first + count}) outside [0, {self.num_slots})")
        seqlens = SeqLens(count, self.max_pages * self.page_size, device=self.device)
        table = self.page_table[first : first + count]
        layers = []
        for layer in self.layers:
            if isinstance(layer, KDACache):
                layers.append(KDACache(*(t[first : first + count] for t in layer_tensors(layer))))
            else:
                layers.append(PagedLatentCache(layer, table, seqlens))
        return PagedBatch(layers, seqlens)

    def set_pages(self, slot: int, pages: Sequence[int]) -> None:
        """Point slot's page-table row at `pages` (the rest at the scratch page 0)."""
        if len(pages) > self.max_pages:
            raise ValueError(f"PagedCache.set_pages: {len(pages)} pages, a row holds {self.max_pages}")
        row = list(pages) + [0] * (self.max_pages - len(pages))
        self.page_table[slot].copy_(to_device(row, self.device, torch.int32))

    def _slot_tensors(self) -> list[torch.Tensor]:
        """The KDA states and conv tails of every KDA layer, each [num_slots, ...]."""
        return [t for layer in self.layers if isinstance(layer, KDACache) for t in layer_tensors(layer)]

    def clear_slot(self, slot: int) -> None:
        """Zero the KDA states and conv tails of `slot`: a sequence that has not started."""
        for t in self._slot_tensors():
            t[slot].zero_()

    def move_slot(self, src: int, dst: int) -> None:
        """Copy the KDA states and conv tails of slot `src` into slot `dst` (the page table is set by the caller)."""
        for t in self._slot_tensors():
            t[dst].copy_(t[src])

    def nbytes(self) -> int:
        """Bytes of the pools, slots and page table."""
        pools = [layer for layer in self.layers if isinstance(layer, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in [self.page_table, *pools, *self._slot_tensors()])
