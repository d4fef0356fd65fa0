"""HybridCache: what a hybrid model keeps between decoding steps (docs/inference.md, "What is cached").

Per KDA layer a constant-size state (three conv tails and the float32 recurrent state, `KDACache`); per MLA layer the
latent rows `[c ; k_s]` (d_c + d_s numbers per token, `MLACache`). Everything is preallocated for `max_seq_len` tokens
and updated in place, so the same tensors serve every decoding step and a captured CUDA graph.

Lengths live in two places on purpose:
- on the device, int32 `[B]`: in every `MLACache`, where each sequence appends and how far it attends, and here a
  model-level count (the only device record in a model without MLA layers). A decode step reads and advances them
  without a host sync, so it can be replayed from a CUDA graph;
- on the host, one Python int per sequence (`host_lengths`, and the longest one in `MLACache.length`): capacity checks
  and the choice of code path, again without a sync. Eager forwards advance both; a graph replay advances the
  device copy and the caller advances the host copy (`advance_host`).
Sequences of one batch may have different lengths (batched generation of prompts of different lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch


def _tensors(obj) -> list[torch.Tensor]:
    return [v for f in fields(obj) if isinstance(v := getattr(obj, f.name), torch.Tensor)]


def _is_mla(layer) -> bool:
    return hasattr(layer, "rows")


class HybridCache:
    """Per-layer caches of a `HybridLM` for `batch_size` sequences of up to `max_seq_len` tokens each.

    layers: one `KDACache` or `MLACache` per decoder layer, in order (built by `HybridLM.make_cache`).
    lengths: int32 [B] on the cache's device, tokens cached per sequence (advanced by `HybridLM.forward`).
    seq_len: the longest sequence's length, a host int (equal to every sequence's length unless they differ).
    """

    def __init__(self, layers: list, batch_size: int, max_seq_len: int):
        if not layers:
            raise ValueError("HybridCache: layers is empty; expected one KDACache or MLACache per decoder layer")
        self.layers = layers
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        device = _tensors(layers[0])[0].device
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._host = [0] * batch_size

    # ------------------------------------------------------------------------------------------------- lengths
    @property
    def seq_len(self) -> int:
        """Tokens cached for the longest sequence (host counter, no device sync)."""
        return max(self._host)

    @property
    def host_lengths(self) -> list[int]:
        """Tokens cached per sequence, as Python ints (a copy)."""
        return list(self._host)

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def mla_layers(self) -> list:
        return [layer for layer in self.layers if _is_mla(layer)]

    def advance(self, num_tokens: int) -> None:
        """Count `num_tokens` more tokens for every sequence: the device lengths (one in-place add, graph-safe) and
        the host counters. MLA layers advance their own lengths when they append; `HybridLM.forward` calls this."""
        self.lengths += num_tokens
        self._host = [n + num_tokens for n in self._host]

    def advance_host(self, num_tokens: int) -> None:
        """Advance only the host counters (here and in the MLA layers), after a CUDA-graph replay has advanced the
        device lengths."""
        self._host = [n + num_tokens for n in self._host]
        for layer in self.mla_layers():
            layer.length += num_tokens

    def set_lengths(self, lengths: Sequence[int] | int) -> None:
        """Declare that sequence b holds `lengths[b]` tokens (one int: all of them), on the device and the host.

        Used to start from rows written directly (benchmarks) or after `load_sequence`; the caller is responsible for
        the rows and states matching those lengths.
        """
        values = [lengths] * self.batch_size if isinstance(lengths, int) else [int(n) for n in lengths]
        if len(values) != self.batch_size or any(not 0 <= n <= self.max_seq_len for n in values):
            raise ValueError(
                f"HybridCache.set_lengths: expected {self.batch_size} lengths in [0, {self.max_seq_len}], got {values}"
            )
        device_values = torch.tensor(values, dtype=torch.int32).to(self.device)
        self.lengths.copy_(device_values)
        for layer in self.mla_layers():
            layer.lengths.copy_(device_values)
            layer.length = max(values)
        self._host = values

    def reset(self) -> None:
        """Forget every sequence: zero the KDA states and conv tails and all lengths (MLA rows are left as they are:
        nothing past a sequence's length is ever read)."""
        for layer in self.layers:
            if not _is_mla(layer):
                for t in _tensors(layer):
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
            if _is_mla(mine) != _is_mla(theirs):
                raise ValueError("HybridCache.load_sequence: the two caches have different layer types")
            if _is_mla(mine):
                mine.rows[index, :n].copy_(theirs.rows[0, :n])
            else:
                for dst, src in zip(_tensors(mine), _tensors(theirs), strict=True):
                    dst[index].copy_(src[0])
        lengths = self.host_lengths
        lengths[index] = n
        self.set_lengths(lengths)

    # ---------------------------------------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        """Bytes of cached data: the preallocated MLA rows in full, KDA states and conv tails (the int32 length
        bookkeeping, 4 bytes per sequence per tensor, is not counted)."""
        return sum(
            t.numel() * t.element_size() for layer in self.layers for t in _tensors(layer) if t.is_floating_point()
        )

    def __repr__(self) -> str:
        kinds = "".join("M" if _is_mla(layer) else "K" for layer in self.layers)
        return (
            f"HybridCache(layers={kinds}, batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, "
            f"host_lengths={self._host}, nbytes={self.nbytes():,})"
        )
