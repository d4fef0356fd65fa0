"""A run's validation: the loss and bits per byte on fixed windows of both splits, the lines it prints and the loss
plot it redraws."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hybrid_attention.data.batches import unigram_loss
from hybrid_attention.training.metrics import evaluate
from hybrid_attention.training.plots import plot_losses
from hybrid_attention.training.report import memory_line, peak_memory, validation_line


class Validation:
    """Evaluates `model` on both splits (the same windows at every call) and reports it.

    train_tokens, val_tokens: [N], [M] token ids on the model's device; byte_lengths: [vocab] bytes per token."""

    def __init__(self, model, train_tokens, val_tokens, tokenizer, autocast, config, run_dir: Path, main: bool):
        self.model, self.train_tokens, self.val_tokens = model, train_tokens, val_tokens
        self.byte_lengths = tokenizer.byte_lengths().to(val_tokens.device)
        self.autocast, self.run_dir, self.main = autocast, run_dir, main
        self.kw = dict(batch_size=config.batch_size, seq_len=config.seq_len, num_batches=config.eval_batches)
        vocab = tokenizer.vocab_size
        self.unigram = unigram_loss(train_tokens.cpu(), val_tokens.cpu(), vocab)
        val_bytes = int(tokenizer.byte_lengths()[val_tokens.cpu().long()].sum())
        self.unigram_bpb = self.unigram * val_tokens.numel() / math.log(2) / val_bytes
        self.last: tuple[float, float] | None = None  # (validation loss, bits per byte) of the latest call
        self._memory_shown = False

    def __call__(self, step: int, row: dict, rows: list[dict], write) -> None:
        """Validate after `step`: fill `row` (val_loss, val_bpb, train_eval_loss), print through `write`, and (on
        the main process) redraw the plot from `rows`, which already holds `row`."""
        self.last = evaluate(self.model, self.val_tokens, self.byte_lengths, autocast=self.autocast, **self.kw)
        row["val_loss"], row["val_bpb"] = self.last
        train = evaluate(self.model, self.train_tokens, self.byte_lengths, autocast=self.autocast, **self.kw)
        row["train_eval_loss"] = train[0]
        write(validation_line(step, row["train_eval_loss"], *self.last, self.unigram))
        device = self.val_tokens.device
        if not self._memory_shown and (memory := peak_memory(device)):  # does the batch fit: known after one step
            write(memory_line(torch.cuda.get_device_name(device), memory))
            self._memory_shown = True
        if self.main:
            plot_losses(self.run_dir, rows)

    @property
    def finite(self) -> bool:
        return self.last is None or math.isfinite(self.last[0])
