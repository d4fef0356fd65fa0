"""The unigram baseline: the validation loss of a model that knows only the training split's token frequencies."""

from __future__ import annotations

import math

import numpy as np
import torch


def unigram_loss(train_tokens: torch.Tensor, val_tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of the validation tokens under add-one-smoothed train unigram frequencies."""
    counts = torch.bincount(train_tokens.long().flatten(), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return float(-log_p[val_tokens.long().flatten()].mean())


UNIGRAM_SAMPLE = 1 << 22  # tokens of each split the baseline reads: every token of a smaller split
_CHUNK = 1 << 20  # tokens counted at a time, so that the baseline's memory does not grow with the corpus


def _sample_runs(split, max_tokens: int):
    """(start, length) runs covering a split (a `ShardSet`) whole, or `max_tokens` of it in 64 evenly spaced runs,
    cut into pieces of at most _CHUNK tokens."""
    n = split.numel()
    runs = (
        [(0, n)] if n <= max_tokens else [(int(s), max_tokens // 64) for s in np.linspace(0, n - max_tokens // 64, 64)]
    )
    return [(s + a, min(_CHUNK, length - a)) for s, length in runs for a in range(0, length, _CHUNK)]


def unigram_baseline(train, val, tokenizer, max_tokens: int = UNIGRAM_SAMPLE) -> tuple[float, float]:
    """(nats per token, bits per byte) of the validation tokens under add-one-smoothed train unigram frequencies
    (`unigram_loss`), with both splits (`ShardSet`s) read whole or sampled to `max_tokens` tokens, a chunk at a time."""
    counts = np.ones(tokenizer.vocab_size, dtype=np.float64)
    for start, length in _sample_runs(train, max_tokens):
        counts += np.bincount(train.read(start, length), minlength=tokenizer.vocab_size)
    log_p = np.log(counts) - np.log(counts.sum())
    byte_lengths = tokenizer.byte_lengths().numpy()
    nll, count, nbytes = 0.0, 0, 0
    for start, length in _sample_runs(val, max_tokens):
        ids = val.read(start, length)
        nll -= float(log_p[ids].sum())
        count, nbytes = count + ids.size, nbytes + int(byte_lengths[ids].sum())
    loss = nll / max(1, count)
    return loss, loss * count / math.log(2) / max(1, nbytes)
