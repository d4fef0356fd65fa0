"""HybridCache: what a hybrid model keeps between decoding steps, preallocated and updated in place: per KDA layer a
constant-size state (`KDACache`), per MLA layer the latent rows (`MLACache`), and one length record for all layers
(docs/inference.md, "What is cached").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from hybrid_attention.layers.kda import KDACache
from hybrid_attention.layers.mla import MLACache
from hybrid_attention.layers.seqlens import SeqLens


def layer_tensors(obj) -> list[torch.Tensor]:
    """The tensors of a per-layer cache (a KDACache or an MLACache dataclass), in field order."""
    return [v for f in fields(obj) if isinstance(v := getattr(obj, f.name), torch.Tensor)]


class LayerCaches:
    """What `HybridLM.forward` and `DecodeStep` read of a cache: `layers` (one per decoder layer: a `KDACache`, or an
    MLA cache counting its tokens with `seqlens`) and the one length record, with what a decode step changes."""

    def __init__(self, layers: list, seqlens: SeqLens):
        self.layers = layers
        self.seqlens = seqlens

    @property
    def batch_size(self) -> int:
        return self.seqlens.batch_size

    @property
    def max_seq_len(self) -> int:
        return self.seqlens.max_seq_len

    @property
    def lengths(self) -> torch.Tensor:
        """int32 [B] on the cache's device: tokens cached per sequence (the record itself, not a copy)."""
        return self.seqlens.lengths

    @property
    def seq_len(self) -> int:
        """Tokens cached for the longest sequence (host count, no device sync)."""
        return self.seqlens.longest

    @property
    def host_lengths(self) -> list[int]:
        """Tokens cached per sequence, as Python ints (a copy)."""
        return self.seqlens.host

    @property
    def device(self) -> torch.device:
        return self.seqlens.device

    def advance(self, num_tokens: int, *, on_device: bool = True) -> None:
        """Count `num_tokens` more tokens for every sequence (`SeqLens.advance`); `HybridLM.forward` calls it."""
        self.seqlens.advance(num_tokens, on_device=on_device)

    def _recurrent_tensors(self) -> list[torch.Tensor]:
        """The KDA states and conv tails: what a step overwrites, as opposed to the MLA rows it appends."""
        return [t for layer in self.layers if isinstance(layer, KDACache) for t in layer_tensors(layer)]

    def snapshot(self) -> tuple[list[int], list[torch.Tensor]]:
        """What a decoding step changes besides the rows past each sequence's length: the lengths (host ints) and
        copies of the KDA states and conv tails. `restore` puts them back (DecodeStep captures on a filled cache)."""
        return self.host_lengths, [t.clone() for t in self._recurrent_tensors()]

    def restore(self, snapshot: tuple[list[int], list[torch.Tensor]]) -> None:
        """Undo every decoding step since `snapshot` (MLA rows written past the lengths are never read)."""
        lengths, saved = snapshot
        mine = self._recurrent_tensors()
        if len(mine) != len(saved) or any(a.shape != b.shape for a, b in zip(mine, saved, strict=True)):
            raise ValueError(f"{type(self).__name__}.restore: the snapshot was taken from a cache of another shape")
        for t, copy in zip(mine, saved, strict=True):
            t.copy_(copy)
        self.seqlens.set(lengths)


class HybridCache(LayerCaches):
    """Per-layer caches of a `HybridLM` for `seqlens.batch_size` sequences of up to `seqlens.max_seq_len` tokens.

    layers: one `KDACache` or `MLACache` per decoder layer, in order (built by `HybridLM.make_cache`); every
        `MLACache` counts its tokens with `seqlens`.
    seqlens: the tokens cached per sequence (advanced by `HybridLM.forward`).
    """

    def __init__(self, layers: list[KDACache | MLACache], seqlens: SeqLens):
        if not layers:
            raise ValueError("HybridCache: layers is empty; expected one KDACache or MLACache per decoder layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, (KDACache, MLACache)):
                raise ValueError(f"HybridCache: layers[{i}] is a {type(layer).__name__}; expected KDACache or MLACache")
            if isinstance(layer, MLACache) and layer.seqlens is not seqlens:
                raise ValueError(f"HybridCache: the MLA cache of layers[{i}] counts its tokens with another SeqLens")
        super().__init__(layers, seqlens)

    def set_lengths(self, lengths: Sequence[int] | int) -> None:
        """Declare that sequence b holds `lengths[b]` tokens (one int: all of them), on the device and the host.

        Used to start from rows written directly (benchmarks) or after `load_sequence`; the caller is responsible for
        the rows and states matching those lengths.
        """
        self.seqlens.set(lengths)

    def reset(self) -> None:
        """Forget every sequence: zero the KDA states and conv tails and the lengths (MLA rows are left as they are:
        nothing past a sequence's length is ever read)."""
        for t in self._recurrent_tensors():
            t.zero_()
        self.set_lengths(0)

    def load_sequence(self, index: int, single: HybridCache) -> None:
        """Copy the batch-1 cache `single` into sequence `index` of this cache (the rows it holds, the KDA states and
        conv tails, its length). Batched generation prefills each prompt alone into `single`, then loads it here, so
        every sequence starts decoding exactly as it would alone."""
        if single.batch_size != 1 or len(single.layers) != len(self.layers):
            raise ValueError(
                f"HybridCache.load_sequence: expected a batch-1 cache with {len(self.layers)} layers, got batch "
                f"{single.batch_size} with {len(single.layers)} layers"
            )
        if not 0 <= index < self.batch_size:
            raise ValueError(f"HybridCache.load_sequence: index {index} is outside [0, {self.batch_size})")
        n = single.seq_len
        if n > self.max_seq_len:
            raise ValueError(f"HybridCache.load_sequence: {n} tokens do not fit max_seq_len {self.max_seq_len}")
        for mine, theirs in zip(self.layers, single.layers, strict=True):
            if type(mine) is not type(theirs):
                raise ValueError("HybridCache.load_sequence: the two caches have different layer types")
            if isinstance(mine, MLACache):
                mine.rows[index, :n].copy_(theirs.rows[0, :n])
            else:
                for dst, src in zip(layer_tensors(mine), layer_tensors(theirs), strict=True):
                    dst[index].copy_(src[0])
        lengths = self.host_lengths
        lengths[index] = n
        self.set_lengths(lengths)

    # ---------------------------------------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        """Bytes of cached data: the preallocated MLA rows in full, KDA states and conv tails (the int32 lengths,
        4 bytes per sequence, are not counted)."""
        return sum(
            t.numel() * t.element_size() for layer in self.layers for t in layer_tensors(layer) if t.is_floating_point()
        )

    def __repr__(self) -> str:
        kinds = "".join("M" if isinstance(layer, MLACache) else "K" for layer in self.layers)
        return (
            f"HybridCache(layers={kinds}, batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, "
            f"host_lengths={self.host_lengths}, nbytes={self.nbytes():,})"
        )
