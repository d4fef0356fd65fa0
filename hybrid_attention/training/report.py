"""What a training run reports, and when: the validation schedule, the epochs a run will read, the train/validation gap,
and peak memory as a fraction of the card (docs/training.md, "What a run reports").
"""

from __future__ import annotations

import torch

VALIDATIONS_PER_RUN = 10


def validation_interval(steps: int, eval_every: int | None) -> int:
    """Steps between validations: `eval_every`, or a tenth of the run (at least 1) when it is None."""
    return eval_every if eval_every is not None else max(1, steps // VALIDATIONS_PER_RUN)


def is_validation_step(step: int, steps: int, eval_every: int | None) -> bool:
    """Whether step `step` (1-based) of a `steps`-step run validates: the first, every interval, and the last."""
    return step == 1 or step % validation_interval(steps, eval_every) == 0 or step == steps


def epochs(steps: int, tokens_per_step: int, train_tokens: int) -> float:
    """Passes over the training split that `steps` steps of `tokens_per_step` tokens make."""
    return steps * tokens_per_step / max(1, train_tokens)


def epoch_report(steps: int, tokens_per_step: int, train_tokens: int) -> tuple[str, str | None]:
    """(a line on how much of the training split the run reads, a warning when that is more than once, else None)."""
    n = epochs(steps, tokens_per_step, train_tokens)
    line = (
        f"schedule: {steps:,} steps x {tokens_per_step:,} tokens = {steps * tokens_per_step:,} tokens, "
        f"{n:.2f} epochs of the {train_tokens:,}-token training split"
    )
    if n <= 1.0:
        return line, None
    warning = (
        f"warning: --steps {steps} reads the training split {n:.1f} times; a model that sees the same text again "
        f"can memorise it (validation loss rises while the training loss falls). Use more data (--data python-env, "
        f"a larger --data-max-bytes) or fewer --steps."
    )
    return line, warning


def validation_line(step: int, train_loss: float, val_loss: float, val_bpb: float, unigram: float) -> str:
    """One line per validation: losses on training and validation windows, their gap, and the unigram baseline."""
    return (
        f"step {step}: train windows {train_loss:.4f}, validation {val_loss:.4f} nats/token ({val_bpb:.3f} bits/byte), "
        f"gap {val_loss - train_loss:+.4f}; unigram baseline {unigram:.4f}"
    )


def peak_memory(device: torch.device) -> dict | None:
    """Peak allocated and reserved bytes of this process on a CUDA `device`, and the card's size; None elsewhere."""
    if device.type != "cuda":
        return None
    return {
        "allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.max_memory_reserved(device),
        "total": torch.cuda.get_device_properties(device).total_memory,
    }


def memory_line(name: str, memory: dict) -> str:
    """`name: peak memory ...` from a `peak_memory` dict; the fraction is of what the allocator reserved, which is
    what the card must hold."""
    gib = 2.0**30
    return (
        f"{name}: peak memory {memory['allocated'] / gib:.1f} GiB allocated, {memory['reserved'] / gib:.1f} GiB "
        f"reserved, {memory['reserved'] / memory['total']:.0%} of the card's {memory['total'] / gib:.1f} GiB"
    )
