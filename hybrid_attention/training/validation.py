"""A run's validation: the loss and bits per byte on fixed windows of both splits, the lines it prints and the loss
plot it redraws."""

from __future__ import annotations

import math
import sys

import torch

from hybrid_attention.data.unigram import unigram_baseline
from hybrid_attention.runs.checkpoint import PLOT
from hybrid_attention.training.metrics import evaluate
from hybrid_attention.training.plots import plot_losses
from hybrid_attention.training.report import memory_line, peak_memory, validation_line


class Validation:
    """Evaluates `model` on both splits of a prepared run `p` (the same windows at every call, read from the shards in
    place) and reports it; with --doc-mask each window is cut at its document starts, as training cuts them."""

    def __init__(self, model, p, autocast, config, main: bool):
        self.model, self.train_tokens, self.val_tokens = model, p.train_tokens, p.val_tokens
        self.device = p.device
        self.byte_lengths = p.tokenizer.byte_lengths().to(p.device)
        self.autocast, self.run_dir, self.main = autocast, p.run_dir, main
        self.kw = dict(batch_size=config.batch_size, seq_len=config.seq_len, num_batches=config.eval_batches)
        self.kw["documents"] = config.doc_mask
        self.unigram, self.unigram_bpb = unigram_baseline(p.train_tokens, p.val_tokens, p.tokenizer)
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
        device = self.device
        if not self._memory_shown and (memory := peak_memory(device)):  # does the batch fit: known after one step
            write(memory_line(torch.cuda.get_device_name(device), memory))
            self._memory_shown = True
        if self.main:
            try:
                plot_losses(self.run_dir, rows)
            except OSError as e:  # a picture of log.jsonl: never worth the checkpoint that follows
                write(f"warning: could not write {self.run_dir / PLOT} ({e}); training goes on", file=sys.stderr)

    @property
    def finite(self) -> bool:
        return self.last is None or math.isfinite(self.last[0])
