"""A run's preparation: data, tokenizer, model, optimizers and the checkpoint to resume from, all checked before the
first byte of the run directory is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.data.loader import check_eval_windows
from hybrid_attention.data.shards import ShardSet
from hybrid_attention.data.tokenizer import Tokenizer, tokenizer_from_dict
from hybrid_attention.data.training_data import TrainingData, open_training_data
from hybrid_attention.device import resolve_device, resolve_dtype
from hybrid_attention.machine import check_fits
from hybrid_attention.model import HybridLM
from hybrid_attention.model_size import check_model_fits
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import dist_checkpoint, run_config
from hybrid_attention.runs.rundir import check_fingerprint
from hybrid_attention.training import distributed
from hybrid_attention.training.activation_checkpointing import apply_activation_checkpointing
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.fp8 import check_fp8, convert_to_fp8
from hybrid_attention.training.optim import apply_schedule, build_optimizers, build_schedulers


@dataclass
class Prepared:
    """The pieces of a prepared run."""

    run_dir: Path
    device: torch.device
    data: TrainingData
    model: HybridLM
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    step: int  # the step of the checkpoint resumed from (0 for a new run)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.data.tokenizer

    @property
    def train_tokens(self) -> ShardSet:
        """The training split's token ids, read in place."""
        return self.data.train

    @property
    def val_tokens(self) -> ShardSet:
        return self.data.val

    @property
    def fingerprint(self) -> dict:
        """data/shards.py's fingerprint of the data."""
        return self.data.fingerprint

    @property
    def token_cache(self) -> Path | None:
        """The token-cache folder the shards came from, when it held them."""
        return self.data.root if self.data.cached else None


def prepare(
    config: TrainConfig, *, resume: bool, par: distributed.Parallel | None = None, model_overrides=None
) -> Prepared:
    """Everything a run needs, checked, before anything is written.

    With a sharded `par` (torchrun), the model is sharded with FSDP2 before its optimizers are built.
    `model_overrides`: HybridConfig fields set over the preset's in a new run (saved in config.json with the model)."""
    par = par or distributed.Parallel.single()
    run_dir = Path(config.out)
    saved = None
    if resume:
        saved = run_config.load_config(run_dir)
    elif run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file, not a directory")
    elif ckpt.holds_run(run_dir):
        raise ValueError(f"--out {run_dir} already holds a run; pass --resume to continue it, or choose another --out")
    device = par.device if par.sharded else resolve_device(config.device)
    if config.cuda_graph and par.sharded:
        raise ValueError(f"--cuda-graph runs in one process; under torchrun ({par.world_size} processes) leave it off")
    if config.cuda_graph and device.type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device, got {device} (--device {config.device})")
    resolve_dtype(device, config.dtype)  # refuses bf16 on the CPU
    if config.fp8:
        if par.sharded:
            raise ValueError(f"--fp8 runs in one process; under torchrun ({par.world_size} processes) leave it off")
        check_fp8(device)
    step_ids = config.grad_accum * config.batch_size * config.seq_len  # int64 on the device, stacked for one step
    flags = f"--grad-accum {config.grad_accum:,} x --batch-size {config.batch_size:,} x --seq-len {config.seq_len:,}"
    check_fits(8 * step_ids, f"a step's {step_ids:,} token ids ({flags})", device)
    data = open_training_data(
        config.data,
        max_bytes=config.data_max_bytes,
        tokenizer=tokenizer_from_dict(saved["tokenizer"], run_dir) if saved is not None else None,
        new_tokenizer=config.tokenizer,
        vocab_size=config.vocab_size,
        verify=(par.rank, par.world_size),
    )
    tokenizer = data.tokenizer
    if saved is not None:
        try:
            model_config = HybridConfig.from_dict(saved["model"])
        except ValueError as e:
            raise ValueError(f"{run_dir / run_config.CONFIG}: {e}") from None
    else:
        overrides = {**(model_overrides or {}), "vocab_size": tokenizer.vocab_size}
        model_config = HybridConfig.from_preset(config.preset, **overrides)
    if model_config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"{run_dir}/config.json: the model has {model_config.vocab_size} tokens, the tokenizer "
            f"{tokenizer.vocab_size}"
        )
    # Lower bounds: float32 weights and gradients, and AdamW's two moments (Muon keeps one for the matrices).
    per_parameter = (16 if config.optimizer == "adamw" else 12) / par.world_size
    what = f"training the model with {config.optimizer}"
    check_model_fits(model_config, device, bytes_per_parameter=per_parameter, what=what)
    for name, split in (("training", data.train), ("validation", data.val)):
        if split.numel() < config.seq_len:
            raise ValueError(
                f"the {name} split of {data.source} has {split.numel()} tokens, fewer than --seq-len {config.seq_len}"
            )
        check_eval_windows(
            split.numel(), config.batch_size, config.seq_len, config.eval_batches, name, "--eval-batches"
        )
    if saved is not None:
        where = str(run_dir / run_config.CONFIG)
        check_fingerprint(
            saved.get("data_fingerprint"), data.fingerprint, data.source, where, legacy=data.legacy_fingerprint
        )
    torch.manual_seed(config.seed)
    backends = dict(kda_backend=config.kda_backend or "auto", attnres_backend=config.attnres_backend or "auto")
    model = HybridLM(model_config, **backends).to(device)
    if config.fp8:
        convert_to_fp8(model, config.fp8)
    if not par.sharded:  # sharded: each layer before its FSDP group (distributed.shard_model)
        apply_activation_checkpointing(model, config.activation_checkpointing)
    build = build_optimizers
    if par.sharded:
        distributed.shard_for_training(model, par, config, tokenizer, data.train)
        build = distributed.build_optimizers
    optimizers = build(model, optimizer=config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    schedule = dict(warmup=config.warmup, steps=config.steps, min_ratio=config.min_lr_ratio, tails=config.extended_at)
    schedulers = build_schedulers(optimizers, **schedule)
    step = 0
    if saved is not None:
        step = dist_checkpoint.restore_training(run_dir, par, model, optimizers, schedulers)
        if saved["train"].get("steps") != config.steps:  # --extend-steps: the next update follows the new tail
            apply_schedule(schedulers)
        if config.stop_after is not None and step < config.steps and config.stop_after <= step:
            raise ValueError(f"--stop-after {config.stop_after}: the run's checkpoint is already at step {step}")
    return Prepared(
        run_dir=run_dir,
        device=device,
        data=data,
        model=model,
        optimizers=optimizers,
        schedulers=schedulers,
        step=step,
    )
