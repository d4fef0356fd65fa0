"""Optimizers and the learning-rate schedule: AdamW, or Muon for hidden matrices plus AdamW for the rest, with a
linear warm-up and a cosine decay to `min_lr_ratio` of the peak. Muon is `muon.StackedMuon`, torch's update with the
matrices of one shape orthogonalised together."""

from __future__ import annotations

import bisect
import math

import torch
from torch import nn

from hybrid_attention.choices import OPTIMIZERS


def _embedding_and_head(model: nn.Module) -> set[int]:
    """ids of the embedding tables and of the LM head (a direct nn.Linear child projecting to the vocabulary)."""
    vocab = model.config.vocab_size
    found = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    found |= {id(m.weight) for m in model.children() if isinstance(m, nn.Linear) and m.out_features == vocab}
    return found


def param_groups(model: nn.Module, weight_decay: float, *, muon: bool) -> tuple[list[dict], list[nn.Parameter]]:
    """AdamW groups (decay: matrices; no decay: ndim < 2 and `_no_weight_decay`), plus the Muon matrices.

    With `muon`, 2-D hidden weights go to Muon; embeddings, the LM head, norms, gates and biases stay with AdamW.
    """
    special = _embedding_and_head(model)
    decay, no_decay, matrices = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or getattr(p, "_no_weight_decay", False):
            no_decay.append(p)
        elif muon and p.ndim == 2 and id(p) not in special:
            matrices.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]], matrices


def build_optimizers(
    model: nn.Module, *, optimizer: str, lr: float, weight_decay: float
) -> list[torch.optim.Optimizer]:
    """[AdamW] or [StackedMuon, AdamW] for `optimizer` "adamw" or "muon". Muon uses AdamW-matched update RMS, so one
    learning rate serves both."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    groups, matrices = param_groups(model, weight_decay, muon=optimizer == "muon")
    fused = next(model.parameters()).is_cuda
    adamw = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    if optimizer == "adamw":
        return [adamw]
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    from hybrid_attention.training.muon import (
        StackedMuon,  # subclasses torch.optim.Muon: imported once it is known to exist
    )

    muon = StackedMuon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return [muon, adamw]


def lr_factor(step: int, *, warmup: int, steps: int, min_ratio: float, tails: tuple[int, ...] = ()) -> float:
    """Multiplier of --lr for the update that follows `step` completed steps: linear warm-up, cosine to min_ratio.

    `tails`: the steps where the run was extended (`--extend-steps`), each the start of a tail up to the next one (or
    `steps`): the rate rises linearly from min_ratio back to --lr over min(warmup, a fifth of the tail) steps and
    decays by a cosine to min_ratio at the tail's end. The schedule before a tail stays as it was."""
    bounds = [0, *tails, steps]
    k = min(bisect.bisect_right(bounds, step), len(bounds) - 1) - 1  # the segment `step` falls in (the last past it)
    start, end = bounds[k], bounds[k + 1]
    warm = warmup if k == 0 else min(warmup, (end - start) // 5)
    floor = 0.0 if k == 0 else min_ratio  # a tail starts from the rate the schedule before it ended at
    if step - start < warm:
        return floor + (1.0 - floor) * (step - start + 1) / warm
    progress = (step - start - warm) / max(1, end - start - warm)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_schedulers(
    optimizers, *, warmup: int, steps: int, min_ratio: float, tails: tuple[int, ...] = ()
) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One LambdaLR per optimizer, all following `lr_factor`."""
    factor = lambda step: lr_factor(step, warmup=warmup, steps=steps, min_ratio=min_ratio, tails=tails)
    return [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in optimizers]


def apply_schedule(schedulers) -> None:
    """Set each optimizer's rate to what its scheduler gives at its current step: after a checkpoint loads into
    schedulers built with a new tail, the rate stored with the optimizer is the old schedule's."""
    for sched in schedulers:
        rates = [base * factor(sched.last_epoch) for base, factor in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(sched.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        sched._last_lr = rates  # what get_last_lr() reports (torch keeps it in this attribute)
