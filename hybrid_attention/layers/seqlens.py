"""SeqLens, the one length record of a decoding cache: int32 `lengths` [B] on the device (kernels read it, a captured
graph advances it) and Python ints on the host (capacity checks, path choice); docs/inference.md, "What is cached".
The caller advances before feeding T tokens, so an MLA layer writes its rows at `lengths - T .. lengths - 1` and
attends up to `lengths`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_attention.device import to_device


class SeqLens:
    """Tokens cached for each of `batch_size` sequences, at most `max_seq_len` each, on `device` and on the host."""

    def __init__(self, batch_size: int, max_seq_len: int, device: torch.device | str | None = None):
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"SeqLens: batch_size={batch_size}, max_seq_len={max_seq_len}; expected both >= 1")
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._host = [0] * batch_size

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    @property
    def host(self) -> list[int]:
        """Tokens cached per sequence, as Python ints (a copy; no device sync)."""
        return list(self._host)

    @property
    def longest(self) -> int:
        return max(self._host)

    @property
    def shortest(self) -> int:
        return min(self._host)

    def advance(self, num_tokens: int, *, on_device: bool = True) -> None:
        """Count `num_tokens` more tokens for every sequence: on the device (one in-place add, graph-safe) unless
        `on_device` is False (a graph replay did it), and on the host. Raises, changing nothing, past capacity."""
        if self.longest + num_tokens > self.max_seq_len:
            raise ValueError(
                f"SeqLens: capacity is {self.max_seq_len} tokens, but {num_tokens} more after the {self.longest} "
                f"already cached need {self.longest + num_tokens}"
            )
        if on_device:
            self.lengths += num_tokens
        self._host = [n + num_tokens for n in self._host]

    def set(self, lengths: Sequence[int] | int) -> None:
        """Sequence b holds `lengths[b]` tokens (one int: all of them), on the device and the host."""
        values = [lengths] * self.batch_size if isinstance(lengths, int) else [int(n) for n in lengths]
        if len(values) != self.batch_size or any(not 0 <= n <= self.max_seq_len for n in values):
            raise ValueError(
                f"SeqLens.set: expected {self.batch_size} lengths in [0, {self.max_seq_len}], got {values}"
            )
        self.lengths.copy_(to_device(values, self.device, torch.int32))  # no wait for the GPU
        self._host = values

    def __repr__(self) -> str:
        return f"SeqLens(host={self._host}, max_seq_len={self.max_seq_len}, device={self.device})"
