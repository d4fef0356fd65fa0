"""Plots of a run: the training and validation loss curves (loss.png in the run directory)."""

from __future__ import annotations

from pathlib import Path

from hybrid_attention.files import atomic_write
from hybrid_attention.runs.checkpoint import PLOT


def plot_losses(run_dir: str | Path, rows: list[dict]) -> None:
    """loss.png: training loss per logged step; validation loss and the loss on fixed training windows per
    evaluation (Agg backend, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    held = [r for r in rows if "train_eval_loss" in r]  # the same windows each time: the gap without batch noise
    if held:
        ax.plot([r["step"] for r in held], [r["train_eval_loss"] for r in held], "s--", label="train windows", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        atomic_write(Path(run_dir) / PLOT, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    finally:
        plt.close(fig)
