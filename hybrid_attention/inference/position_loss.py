"""The validation loss against position in a window, up to many times the length a model trained on: each window goes
through the cache in chunks (as a long prompt's prefill does), with the logits of one chunk at a time, so memory is
bounded at any window length (docs/fidelity.md, "Loss against position")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybrid_attention.data.loader import eval_starts
from hybrid_attention.inference.prefill import (
    PROGRESS_DELAY_S,
    activation_budget,
    activation_bytes_per_token,
    chunk_size_for,
)

# Bytes per token of a chunk's logits beyond the activations: the head's output, its float32 copy and the
# log-softmax of the loss, each [vocab] per token (the largest at 4 bytes each).
LOGIT_COPIES = 3


def position_buckets(seq_len: int, num_buckets: int | None = None) -> list[tuple[int, int]]:
    """Buckets [start, stop) of target positions 1 .. seq_len - 1 (position p: the p-th token of a window, predicted
    from the p tokens before it): [1, 2), [2, 4), [4, 8), ... by powers of two, the last one ending at seq_len; or
    `num_buckets` of (nearly) equal width."""
    if seq_len < 2:
        raise ValueError(f"position_buckets: seq_len={seq_len}; a window needs at least 2 tokens (one prediction)")
    if num_buckets is None:
        edges = [1 << k for k in range(seq_len.bit_length()) if 1 << k < seq_len] + [seq_len]
    else:
        if not 1 <= num_buckets <= seq_len - 1:
            raise ValueError(
                f"position_buckets: {num_buckets} buckets over the {seq_len - 1} predicted positions of a window of "
                f"{seq_len} tokens; expected 1 to {seq_len - 1}"
            )
        edges = np.round(np.linspace(1, seq_len, num_buckets + 1)).astype(int).tolist()
    return list(zip(edges[:-1], edges[1:], strict=True))


def logits_chunk_size(model, batch_size: int) -> int:
    """Tokens per sequence per call for `token_losses`: `prefill_chunk_size`'s rule with the chunk's logits counted."""
    weight = model.embed.weight
    per_token = activation_bytes_per_token(model.config, weight.element_size())
    return chunk_size_for(
        activation_budget(weight.device), per_token + LOGIT_COPIES * 4 * model.config.vocab_size, batch_size
    )


@torch.no_grad()
def token_losses(model, x: torch.Tensor, *, chunk_size: int | None = None, bar=None) -> torch.Tensor:
    """Cross-entropy of every target of windows x [B, N]: nll [B, N - 1] (float32), nll[:, p - 1] for the token at
    position p predicted from positions 0 .. p - 1.

    The windows go through a fresh cache `chunk_size` tokens at a time (None: `logits_chunk_size`), the model in its
    own dtype as `generate` runs it; the last position of a chunk predicts the first token of the next one. bar: a
    tqdm bar advanced by the tokens fed."""
    B, N = x.shape
    if N < 2:
        raise ValueError(f"token_losses: windows of {N} token(s); expected at least 2 (one prediction)")
    chunk = chunk_size or logits_chunk_size(model, B)
    cache = model.make_cache(B, N)
    nll = torch.empty(B, N - 1, dtype=torch.float32, device=x.device)
    for start in range(0, N, chunk):
        stop = min(N, start + chunk)
        logits = model(x[:, start:stop], cache=cache).logits  # (B, stop - start, vocab)
        n = min(stop, N - 1) - start  # the predictions of this chunk: targets start + 1 .. start + n
        if n > 0:
            targets = x[:, start + 1 : start + 1 + n]
            flat = F.cross_entropy(logits[:, :n].flatten(0, 1).float(), targets.flatten(), reduction="none")
            nll[:, start : start + n] = flat.view(B, n)
        del logits
        if bar is not None:
            bar.update(B * (stop - start))
    return nll


@dataclass
class PositionLoss:
    """Mean loss per target position over the windows, and per bucket."""

    seq_len: int
    windows: int
    position_loss: np.ndarray  # float64 [seq_len - 1]: the mean loss at positions 1 .. seq_len - 1
    position_bytes: np.ndarray  # int64 [seq_len - 1]: bytes of the targets at each position, over all windows
    buckets: list[tuple[int, int]]

    @property
    def loss(self) -> float:
        """The mean over every prediction: what the plain validation loss of these windows is."""
        return float(self.position_loss.mean())

    @property
    def bits_per_byte(self) -> float:
        return float(self.position_loss.sum() * self.windows / math.log(2) / max(1, int(self.position_bytes.sum())))

    def rows(self, train_seq_len: int | None = None) -> list[dict]:
        """One dict per bucket: start, stop (positions), tokens (predictions counted), loss, bits per byte, and with
        `train_seq_len`, past_training: whether its positions lie past those training windows of that length predict
        ("yes", "partly" or "no")."""
        out = []
        for start, stop in self.buckets:
            losses = self.position_loss[start - 1 : stop - 1]
            nbytes = int(self.position_bytes[start - 1 : stop - 1].sum())
            row = {
                "start": start,
                "stop": stop,
                "tokens": int(len(losses) * self.windows),
                "loss": float(losses.mean()),
                "bpb": float(losses.sum() * self.windows / math.log(2) / max(1, nbytes)),
            }
            if train_seq_len is not None:  # training windows of L tokens predict positions 1 .. L - 1
                row["past_training"] = "yes" if start >= train_seq_len else "partly" if stop > train_seq_len else "no"
            out.append(row)
        return out


def _windows(split, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """Windows [len(starts), seq_len] of a split: a 1-D token tensor or a `ShardSet`."""
    if isinstance(split, torch.Tensor):
        index = torch.from_numpy(starts)[:, None].to(split.device) + torch.arange(seq_len, device=split.device)
        return split[index]
    return torch.from_numpy(split.windows(starts, seq_len))


@torch.no_grad()
def position_losses(
    model,
    split,
    byte_lengths: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    buckets: list[tuple[int, int]],
    chunk_size: int | None = None,
    progress: bool | None = None,
) -> PositionLoss:
    """The loss at each position of `num_batches * batch_size` windows of `seq_len` tokens evenly spaced over
    `split` (1-D token ids or a `ShardSet`; `loader.eval_starts`, the windows `evaluate` reads), bucketed by
    `buckets`.
    byte_lengths: [vocab] bytes of each token (for bits per byte). progress: as `inference.prefill.prefill`'s."""
    was_training = model.training
    model.eval()
    device = model.embed.weight.device
    starts = eval_starts(split.numel(), batch_size, seq_len, num_batches)
    total = torch.zeros(seq_len - 1, dtype=torch.float64, device=device)
    nbytes = torch.zeros(seq_len - 1, dtype=torch.long, device=device)
    byte_lengths = byte_lengths.to(device)  # once, not per batch
    delay = 0.0 if progress else PROGRESS_DELAY_S
    bar = tqdm(
        total=len(starts) * seq_len,
        desc="per position",
        unit="token",
        unit_scale=True,
        delay=delay,
        disable=progress is False,
    )
    with bar:
        for i in range(0, len(starts), batch_size):
            x = _windows(split, starts[i : i + batch_size], seq_len).to(device).long()
            total += token_losses(model, x, chunk_size=chunk_size, bar=bar).double().sum(0)
            nbytes += byte_lengths[x[:, 1:]].sum(0)
    model.train(was_training)
    per_position = (total / len(starts)).cpu().numpy()
    if not np.isfinite(per_position).all():
        raise ValueError(f"the loss is not finite at {int((~np.isfinite(per_position)).sum())} positions")
    return PositionLoss(seq_len, len(starts), per_position, nbytes.cpu().numpy(), buckets)
