"""Training curves for TensorBoard and Weights & Biases, beside the run's own log.jsonl (docs/training.md, "Curves")."""

from __future__ import annotations

import os
from pathlib import Path

import torch

TENSORBOARD_DIR = "tensorboard"
_GIB = 2.0**30
_SCALARS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "val_bpb": "val/bpb",
    "train_eval_loss": "train/eval_loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "allocated_gib": "memory/allocated_gib",
    "reserved_gib": "memory/reserved_gib",
    "host_peak_gib": "memory/host_peak_gib",
}


def scalars(row: dict, *, device: torch.device, flops_per_token: float, peak_flops: float | None) -> dict[str, float]:
    """The scalars of one log row (docs/training.md, "Curves"), with MFU and memory added."""
    values = {k: row[k] for k in _SCALARS if k in row and row[k] is not None}
    if peak_flops and "tokens_per_s" in row:
        values["mfu"] = flops_per_token * row["tokens_per_s"] / peak_flops
    values["host_peak_gib"] = host_peak_bytes() / _GIB
    if device.type == "cuda":
        values["allocated_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        values["reserved_gib"] = torch.cuda.max_memory_reserved(device) / _GIB
    return {_SCALARS[k]: float(v) for k, v in values.items()}


def host_peak_bytes() -> int:
    """The peak resident memory of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Reporters:
    """The writers `--report-to` names; `log(step, values)` sends the scalars to each, `close()` flushes them."""

    def __init__(self, names, run_dir: Path, config: dict, *, resume: bool):
        self._tensorboard = self._wandb = None
        if "tensorboard" in names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # torch's writer needs the tensorboard package
                raise ValueError(
                    "--report-to tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            self._tensorboard = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))
        if "wandb" in names:
            try:
                import wandb
            except ImportError:
                raise ValueError("--report-to wandb needs the wandb package: pip install wandb") from None
            project = os.environ.get("WANDB_PROJECT", "hybrid-attention")
            self._wandb = wandb.init(
                project=project,
                dir=str(run_dir),
                name=Path(run_dir).name,
                config=config,
                resume="allow" if resume else None,
            )

    def log(self, step: int, values: dict[str, float]) -> None:
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
