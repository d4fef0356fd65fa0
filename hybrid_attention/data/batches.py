"""Token batches: training windows drawn from a generator seeded by (seed, step, micro-batch), so any step's batch can
be rebuilt without replaying the ones before it; fixed validation windows; the unigram baseline."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch


def _step_seed(seed: int, step: int, micro: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{step}:{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def _to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU index moved to `device` without a host sync: a copy from pageable memory waits for the GPU's queue,
    one from pinned memory is queued behind it (torch keeps the pinned buffer alive until the copy has run)."""
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, *, seed: int, step: int, micro: int = 0):
    """`batch_size` contiguous windows of `seq_len` tokens, drawn from a generator seeded by (seed, step, micro).

    tokens: [N] integer ids. Returns a LongTensor [batch_size, seq_len] on the device of `tokens`.
    """
    n = tokens.numel()
    if n < seq_len:
        raise ValueError(f"the training split has {n} tokens, fewer than one window of --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(_step_seed(seed, step, micro))
    starts = torch.randint(0, n - seq_len + 1, (batch_size,), generator=gen)
    index = starts[:, None] + torch.arange(seq_len)  # (B, T)
    return tokens[_to_device(index, tokens.device)].long()


def eval_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, num_batches: int | None = None
) -> Iterator[torch.Tensor]:
    """Fixed validation windows [batch_size, seq_len] (long), the same at every evaluation.

    With `num_batches`, `num_batches * batch_size` windows evenly spaced over the split (non-overlapping when the
    split is long enough; every batch full, so a compiled model sees one shape). Without it, every
    non-overlapping window in order, the last batch possibly smaller.
    """
    n = tokens.numel()
    if n < seq_len:
        raise ValueError(f"the validation split has {n} tokens, fewer than one window of --seq-len {seq_len}")
    if num_batches is None:
        starts = torch.arange(0, n - seq_len + 1, seq_len)
    else:
        # float64: float32 rounds odd starts above 2**24 up by one, past the end of a split that long
        starts = torch.linspace(0, n - seq_len, num_batches * batch_size, dtype=torch.float64).round().long()
    for i in range(0, starts.numel(), batch_size):
        index = starts[i : i + batch_size, None] + torch.arange(seq_len)
        yield tokens[_to_device(index, tokens.device)].long()


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


def unigram_loss(train_tokens: torch.Tensor, val_tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of the validation tokens under add-one-smoothed train unigram frequencies."""
    counts = torch.bincount(train_tokens.long().flatten(), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return float(-log_p[val_tokens.long().flatten()].mean())
