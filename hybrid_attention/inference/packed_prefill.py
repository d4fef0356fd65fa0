"""The first prompt chunks of several sequences in one forward: packed back to back along T as documents (the
varlen path training uses for packed documents), each starting from an empty cache, with every document's KDA
state, conv tails and MLA rows written into its own slot of a `PagedCache` (docs/inference.md, "Serving").

An eager forward costs the host about the same whatever its length (every layer's launches), so new prompts that
prefill together in one forward, instead of one forward each, leave the GPU less idle between them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_attention.device import to_device
from hybrid_attention.layers.documents import PackedDocuments
from hybrid_attention.layers.kda import KDACache


class SlotStates:
    """One KDA layer's slots for packed documents: `store` writes document n's final state and conv tails to slot
    slots[n] of the layer's pool tensors (each [num_slots, ...])."""

    packs_documents = True

    def __init__(self, pool: KDACache, slots: torch.Tensor):
        self.pool, self.slots = pool, slots

    def store(self, state: torch.Tensor, conv_inputs: Sequence[torch.Tensor], docs: PackedDocuments) -> None:
        """state [N, H, K, V]: each document's state after its last token; conv_inputs: the inputs [1, T, C] of the
        q, k and v convolutions, whose last conv_size - 1 rows of each document (zeros before its start) are that
        sequence's conv tails [C, conv_size - 1]."""
        self.pool.state.index_copy_(0, self.slots, state.to(self.pool.state.dtype))
        width = self.pool.conv_q.shape[-1]
        if width == 0:
            return
        starts, ends = docs.cu_seqlens[:-1].long(), docs.cu_seqlens[1:].long()
        rows = ends[:, None] - width + torch.arange(width, device=ends.device)  # (N, W - 1): the tail's tokens
        inside = (rows >= starts[:, None])[..., None]  # rows before a document's start are its zero left context
        for tails, x in zip((self.pool.conv_q, self.pool.conv_k, self.pool.conv_v), conv_inputs, strict=True):
            taken = x[0][rows.clamp(min=0)] * inside  # (N, W - 1, C)
            tails.index_copy_(0, self.slots, taken.transpose(1, 2).to(tails.dtype))


class SlotRows:
    """One MLA layer's pages for packed documents: `store` writes the rows of document n, token p, at row p % page
    of page page_table[slots[n], p // page] (the positions computed once per forward, shared by the layers)."""

    packs_documents = True

    def __init__(self, pool: torch.Tensor, owner: PackedPrefill):
        self.pool, self.owner = pool, owner

    def store(self, rows: torch.Tensor, docs: PackedDocuments) -> None:
        """rows [1, T, d_c + d_s]: every token's latent row."""
        if rows.shape[0] != 1 or rows.shape[2] != self.pool.shape[2]:
            raise ValueError(
                f"PackedPrefill: rows {tuple(rows.shape)}; expected [1, T, {self.pool.shape[2]}] (the pool's width)"
            )
        flat = self.owner.row_index(docs)
        self.pool.view(-1, self.pool.shape[2]).index_copy_(0, flat, rows[0].to(self.pool.dtype))


class PackedPrefill:
    """What `HybridLM.forward(ids [1, T], cache=..., cu_seqlens=...)` reads when its N documents are the first chunks
    of the sequences in `slots` (one each, in order) of `cache` (a `PagedCache`): their slots must have been cleared
    and their page tables set. The documents' lengths are known to the caller, so nothing here counts tokens."""

    packs_documents = True

    def __init__(self, cache, slots: Sequence[int]):
        if not slots or len(set(slots)) != len(slots) or not all(0 <= s < cache.num_slots for s in slots):
            raise ValueError(f"PackedPrefill: slots {list(slots)}; expected distinct slots in [0, {cache.num_slots})")
        self.cache = cache
        self.slots = to_device(list(slots), cache.device)  # int64 [N] on the cache's device
        self.layers = [
            SlotStates(layer, self.slots) if isinstance(layer, KDACache) else SlotRows(layer, self)
            for layer in cache.layers
        ]
        self._index: tuple[PackedDocuments, torch.Tensor] | None = None  # the forward's documents and row index

    def check_documents(self, docs: PackedDocuments) -> None:
        """One document per slot, each within a sequence's context (host values only: no device sync)."""
        if docs.num_documents != self.slots.shape[0]:
            raise ValueError(
                f"PackedPrefill: {docs.num_documents} documents for {self.slots.shape[0]} slots; expected one each"
            )
        context = self.cache.max_pages * self.cache.page_size
        if docs.max_len > context:
            raise ValueError(f"PackedPrefill: a document of {docs.max_len} tokens; a sequence holds {context}")

    def row_index(self, docs: PackedDocuments) -> torch.Tensor:
        """int64 [T]: where each token's row goes in a pool viewed as [(1 + pages) * page_size, D]."""
        if self._index is None or self._index[0] is not docs:
            page = self.cache.page_size
            lengths = docs.cu_seqlens[1:] - docs.cu_seqlens[:-1]
            owner = torch.repeat_interleave(self.slots, lengths, output_size=docs.positions.shape[1])  # (T,)
            pos = docs.positions[0].long()
            pages = self.cache.page_table[owner, pos // page].long()
            self._index = docs, pages * page + pos % page
        return self._index[1]
