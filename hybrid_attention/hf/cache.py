"""`HybridAttentionCache`: a transformers `Cache` that holds a `HybridCache` (KDA states and MLA latent rows), allocated
on the first forward and grown when a call needs more (docs/transformers.md, "The cache").
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from hybrid_attention.cache import HybridCache
from hybrid_attention.layers.mla import MLACache


def _unsupported(what: str):
    raise NotImplementedError(
        f"HybridAttentionCache: {what} is not supported (KDA keeps one recurrent state per sequence, which cannot be "
        "rolled back or reordered here); use greedy decoding or sampling with num_beams=1"
    )


class HybridAttentionCache(Cache):
    """The decoding cache of `HybridAttentionForCausalLM`.

    Args:
        initial_len: tokens per sequence to allocate room for on the first forward (at least that call's length);
            None: exactly the first call's length. More room is made when needed.
    """

    is_compileable = False

    def __init__(self, initial_len: int | None = None):
        super().__init__(layers=[])
        if initial_len is not None and (not isinstance(initial_len, int) or initial_len < 1):
            raise ValueError(f"HybridAttentionCache: initial_len={initial_len!r}; expected None or >= 1")
        self.initial_len = initial_len
        self.hybrid: HybridCache | None = None
        self.columns = 0  # input columns fed so far (padding included)

    # ------------------------------------------------------------------------------------ used by the model
    def reserve(self, model, batch_size: int, num_tokens: int) -> HybridCache:
        """The `HybridCache` of `model`'s layers for `batch_size` sequences, with room for `num_tokens` more tokens
        per sequence: allocated on the first call, grown (doubling, contents copied) when full."""
        if self.hybrid is None:
            self.hybrid = model.make_cache(batch_size, max(self.initial_len or 0, num_tokens))
            return self.hybrid
        cache = self.hybrid
        if cache.batch_size != batch_size:
            raise ValueError(
                f"HybridAttentionCache: holds {cache.batch_size} sequences, but the input has {batch_size}; a cache "
                "serves one batch (start a new one for a new batch)"
            )
        if len(cache.layers) != len(model.layers):
            raise ValueError(
                f"HybridAttentionCache: holds {len(cache.layers)} layers, the model has {len(model.layers)}"
            )
        needed = cache.seq_len + num_tokens
        if needed > cache.max_seq_len:
            self.hybrid = _grown(model, cache, max(needed, 2 * cache.max_seq_len))
        return self.hybrid

    # ------------------------------------------------------------------------------- transformers' Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # no fixed maximum: the cache grows

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    @property
    def batch_size(self) -> int:
        return -1 if self.hybrid is None else self.hybrid.batch_size

    @property
    def is_initialized(self) -> bool:
        return self.hybrid is not None

    @property
    def is_croppable(self) -> bool:
        return False

    def reset(self) -> None:
        if self.hybrid is not None:
            self.hybrid.reset()
        self.columns = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        _unsupported("reordering (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        _unsupported("cropping (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        _unsupported("repeating the batch of a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        _unsupported("selecting sequences of a filled cache")

    def __repr__(self) -> str:
        return f"HybridAttentionCache(columns={self.columns}, hybrid={self.hybrid!r})"


def _grown(model, cache: HybridCache, max_seq_len: int) -> HybridCache:
    """A copy of `cache` with room for `max_seq_len` tokens per sequence."""
    bigger = model.make_cache(cache.batch_size, max_seq_len)
    for new, old in zip(bigger.layers, cache.layers, strict=True):
        if isinstance(old, MLACache):  # the latent rows written so far
            new.rows[:, : old.rows.shape[1]].copy_(old.rows)
        else:  # KDACache: the recurrent state and the conv tails
            for f in dataclasses.fields(old):
                getattr(new, f.name).copy_(getattr(old, f.name))
    bigger.set_lengths(cache.host_lengths)
    return bigger
