"""What `hybrid-attention eval --per-position` prints and draws: a table of the loss per position bucket, a JSON line,
and the loss against position (one line per run, the training length marked)."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import torch

from hybrid_attention.files import atomic_write

PLOT_FORMATS = (".png", ".pdf", ".svg")


def check_plot_path(path: str) -> Path:
    """The --plot path, checked before any work: a known image suffix and an existing folder."""
    plot = Path(path)
    if plot.suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {path}: expected a file name ending in one of {', '.join(PLOT_FORMATS)}")
    if not plot.parent.is_dir():
        raise ValueError(f"--plot {path}: the folder {plot.parent} does not exist")
    return plot


def table_lines(rows: list[dict]) -> list[str]:
    """A markdown table of the buckets (`PositionLoss.rows`), one line per bucket."""
    header = "| positions | predictions | loss (nats/token) | bits/byte | past the training length |"
    lines = [header, "|---|---|---|---|---|"]
    for r in rows:
        span = f"{r['start']:,}" if r["stop"] == r["start"] + 1 else f"{r['start']:,} - {r['stop'] - 1:,}"
        lines.append(f"| {span} | {r['tokens']:,} | {r['loss']:.4f} | {r['bpb']:.4f} | {r.get('past_training', '')} |")
    return lines


def summary(result, rows: list[dict], **context) -> dict:
    """The JSON line: the run and data (`context`), the windows, the loss overall and per bucket, date and versions."""
    return {
        **context,
        "seq_len": result.seq_len,
        "windows": result.windows,
        "loss": result.loss,
        "bpb": result.bits_per_byte,
        "buckets": rows,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "command": " ".join(["hybrid-attention", *sys.argv[1:]]),
    }


def draw(ax, rows: list[dict], label: str, **style) -> None:
    """One run's bucket losses on `ax`, each at the geometric middle of its positions."""
    middles = [math.sqrt(r["start"] * (r["stop"] - 1)) for r in rows]
    ax.plot(middles, [r["loss"] for r in rows], label=label, **{"marker": "o", "ms": 3, **style})


def plot_position_loss(curves: list[tuple[str, list[dict]]], train_seq_len: int, path: str | Path, title: str) -> None:
    """Loss against position (log scale) for each (label, bucket rows), the training length as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in curves:
        draw(ax, rows, label)
    finish_axes(ax, train_seq_len, title)
    fig.tight_layout()
    suffix = Path(path).suffix.lstrip(".").lower()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format=suffix, dpi=100))
    finally:
        plt.close(fig)


def finish_axes(ax, train_seq_len: int, title: str) -> None:
    ax.axvline(train_seq_len, color="gray", ls="--", lw=1, label=f"training length ({train_seq_len:,})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the window (tokens of context before the target)")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def report(result, *, train_seq_len: int, plot: Path | None, **context) -> None:
    """Print the table and, last, the JSON line; draw `plot` when given."""
    rows = result.rows(train_seq_len)
    print("\n".join(table_lines(rows)))
    if plot is not None:
        title = f"{context.get('ckpt', '')}: {result.windows:,} windows of {result.seq_len:,} tokens"
        plot_position_loss([(str(context.get("ckpt", "")), rows)], train_seq_len, plot, title)
        print(f"wrote {plot}")
    line = summary(result, rows, train_seq_len=train_seq_len, plot=None if plot is None else str(plot), **context)
    print(json.dumps(line))
