"""Streaming training batches from shards: which windows a step reads, each rank's share, and a prefetching thread
(docs/training.md, "The loader").
"""

from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from hybrid_attention.data.shards import ShardSet

ROUNDS = 4  # Feistel rounds: three make a pseudo-random permutation, one more for margin
PREFETCH = 4  # steps computed ahead


def _key(*parts) -> int:
    """A 64-bit key from any values (sha256, so independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a fast, well-spread round function."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A pseudo-random permutation of [0, n) keyed by `key`, applied to `index` (int64 values in [0, n))."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # 4 ** half >= n
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_key(key, r)) for r in range(ROUNDS)]
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():  # cycle walking: re-encrypt what fell outside [0, n); at most 4 tries expected
            left, right = x[todo] >> np.uint64(half), x[todo] & mask
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
            x[todo] = (left << np.uint64(half)) | right
            todo = x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass(frozen=True)
class WindowOrder:
    """Where sample i of a run starts in a split of `num_tokens` tokens (docs/training.md, "The loader")."""

    num_tokens: int
    seq_len: int
    seed: int

    def __post_init__(self):
        if self.num_tokens < self.seq_len:
            raise ValueError(
                f"the training split has {self.num_tokens} tokens, fewer than one window of --seq-len {self.seq_len}"
            )

    @property
    def windows(self) -> int:
        return self.num_tokens // self.seq_len

    def starts(self, samples: np.ndarray) -> np.ndarray:
        """Token offsets of the windows of samples (int64 [S])."""
        n, spare = self.windows, self.num_tokens - self.windows * self.seq_len
        samples = np.asarray(samples, dtype=np.int64)
        out = np.empty_like(samples)
        epochs = samples // n
        for epoch in np.unique(epochs):
            here = epochs == epoch
            shift = _key(self.seed, int(epoch), "shift") % (spare + 1)
            out[here] = shift + self.seq_len * permute(samples[here] % n, n, _key(self.seed, int(epoch)))
        return out


def cu_seqlens_of_rows(doc_starts: list[np.ndarray], seq_len: int) -> torch.Tensor:
    """Rows of `seq_len` tokens packed back to back, each cut at its document starts -> cu_seqlens int32 [N + 1]."""
    cuts = [np.concatenate([[0], starts]) + row * seq_len for row, starts in enumerate(doc_starts)]
    cuts.append(np.array([len(doc_starts) * seq_len]))
    return torch.from_numpy(np.concatenate(cuts).astype(np.int32))


@dataclass
class Batch:
    """One optimizer step's tokens for this rank: ids [grad_accum, B / world, T] (int64, pinned on CUDA) and, with
    documents, the positions of document starts in each row (`ShardSet.document_starts`), per micro-batch."""

    step: int
    ids: torch.Tensor
    doc_starts: list[list[np.ndarray]] | None


class TrainLoader:
    """The batches of a run's steps for one rank, computed `PREFETCH` steps ahead on a thread.

    batch_size is the global batch (all ranks); this rank reads rows [rank * b, (rank + 1) * b) of it, b =
    batch_size / world. `documents`: also find the document starts of every row (for `--doc-mask`)."""

    def __init__(
        self,
        split: ShardSet,
        *,
        batch_size: int,
        seq_len: int,
        grad_accum: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        documents: bool = False,
        pin: bool = False,
    ):
        if batch_size % world:
            raise ValueError(f"--batch-size {batch_size} must be a multiple of the {world} processes")
        self.split, self.order = split, WindowOrder(split.num_tokens, seq_len, seed)
        self.batch_size, self.seq_len, self.grad_accum = batch_size, seq_len, grad_accum
        self.rows = range(rank * (batch_size // world), (rank + 1) * (batch_size // world))
        self.documents, self.pin = documents, pin
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._expected = 0  # the step the thread's next batch is for
        self._stop = threading.Event()

    def batch(self, step: int) -> Batch:
        """The batch of `step` (1-based), computed here."""
        ids = np.empty((self.grad_accum, len(self.rows), self.seq_len), dtype=np.int64)
        starts = [] if self.documents else None
        for micro in range(self.grad_accum):
            first = ((step - 1) * self.grad_accum + micro) * self.batch_size
            offsets = self.order.starts(first + np.asarray(self.rows))
            ids[micro] = self.split.windows(offsets, self.seq_len)
            if self.documents:
                starts.append([self.split.document_starts(int(o), self.seq_len) for o in offsets])
        tensor = torch.from_numpy(ids)
        return Batch(step, tensor.pin_memory() if self.pin else tensor, starts)

    def next(self, step: int) -> Batch:
        """The batch of `step`, from the prefetching thread (started, or restarted, at `step`)."""
        if self._thread is None or self._expected != step:
            self._start(step)
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._expected = step + 1
        return item

    def _start(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=PREFETCH)
        self._expected = step
        self._thread = threading.Thread(target=self._fill, args=(step, self._queue, self._stop), daemon=True)
        self._thread.start()

    def _fill(self, step: int, out: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> None:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        try:
            while not stop.is_set():
                put(self.batch(step))
                step += 1
        except BaseException as err:  # handed to the consumer, which raises it
            put(err)

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def check_eval_windows(num_tokens: int, batch_size: int, seq_len: int, num_batches: int, split: str, flag: str) -> None:
    """ValueError when `num_batches` batches of `batch_size` windows (`eval_batches`) are more than it takes to cover
    every distinct window of a split of `num_tokens` tokens once: beyond that they only repeat windows."""
    distinct = num_tokens - seq_len + 1
    most = max(1, -(-distinct // batch_size))
    if num_batches > most:
        raise ValueError(
            f"{flag} {num_batches:,}: {num_batches * batch_size:,} windows of {seq_len} tokens, more than the "
            f"{distinct:,} distinct windows of the {split} split ({num_tokens:,} tokens); pass at most {most:,}"
        )


def eval_starts(num_tokens: int, batch_size: int, seq_len: int, num_batches: int | None) -> np.ndarray:
    """Fixed validation window starts (int64): `num_batches * batch_size` evenly spaced over the split, or every
    non-overlapping window in order when `num_batches` is None."""
    if num_tokens < seq_len:
        raise ValueError(f"the validation split has {num_tokens} tokens, fewer than one window of --seq-len {seq_len}")
    if num_batches is None:
        return np.arange(0, num_tokens - seq_len + 1, seq_len, dtype=np.int64)
    # float64: float32 rounds odd starts above 2**24 up by one, past the end of a split that long
    return np.round(np.linspace(0, num_tokens - seq_len, num_batches * batch_size, dtype=np.float64)).astype(np.int64)
