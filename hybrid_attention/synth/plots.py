"""accuracy.png: answer accuracy against steps, one panel per task and length, one line per model (its best
learning rate)."""

from __future__ import annotations

import math
from pathlib import Path

from hybrid_attention.files import atomic_write
from hybrid_attention.synth.run import best_by_lr, row_key

PLOT = "accuracy.png"


def plot_accuracy(out: str | Path, rows: list[dict]) -> Path:
    """Write OUT/accuracy.png from log rows (Agg backend, atomic); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_by_lr([r for r in rows if r.get("final")])
    panels = sorted({(task, seq_len) for task, seq_len, _ in best})
    columns = min(4, max(1, len(panels)))
    lines = math.ceil(len(panels) / columns) if panels else 1
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3 * lines), squeeze=False)
    for ax, (task, seq_len) in zip(axes.flat, panels, strict=False):
        for (t, n, model), final in sorted(best.items()):
            if (t, n) != (task, seq_len):
                continue
            curve = sorted((r for r in rows if row_key(r) == row_key(final)), key=lambda r: r["step"])
            ax.plot(
                [r["step"] for r in curve],
                [r["accuracy"] for r in curve],
                "o-",
                ms=3,
                label=f"{model} (lr {final['lr']:g})",
            )
        ax.set_title(f"{task}, length {seq_len}")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel("answer accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(out) / PLOT
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path
