"""A run's preparation: data, tokenizer, model, optimizers and the checkpoint to resume from, all checked before the
first byte of the run directory is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.data.documents import Corpus
from hybrid_attention.data.sources import load_corpus
from hybrid_attention.data.token_cache import encode_corpus
from hybrid_attention.data.tokenizer import (
    DEFAULT_BPE_VOCAB,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    tokenizer_from_dict,
)
from hybrid_attention.device import resolve_device, resolve_dtype
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import dist_checkpoint, run_config
from hybrid_attention.runs.rundir import check_fingerprint, data_fingerprint
from hybrid_attention.training import distributed
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.optim import build_optimizers, build_schedulers


@dataclass
class Prepared:
    """The pieces of a prepared run."""

    run_dir: Path
    device: torch.device
    corpus: Corpus
    tokenizer: Tokenizer
    model: HybridLM
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    step: int  # the step of the checkpoint resumed from (0 for a new run)
    train_tokens: torch.Tensor  # [N] token ids of the training split
    val_tokens: torch.Tensor  # [M] of the validation split
    fingerprint: dict  # runs/rundir.py's data fingerprint
    token_cache: Path | None  # the token-cache file the tokens came from, when it held them


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
    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes)
    if saved is not None:
        tokenizer = tokenizer_from_dict(saved["tokenizer"], run_dir)
        try:
            model_config = HybridConfig.from_dict(saved["model"])
        except ValueError as e:
            raise ValueError(f"{run_dir / run_config.CONFIG}: {e}") from None
    else:
        if config.tokenizer == "bpe":
            tokenizer = BPETokenizer.train(corpus.train, config.vocab_size or DEFAULT_BPE_VOCAB)  # on its first 32 MB
        else:
            tokenizer = ByteTokenizer()
        overrides = {**(model_overrides or {}), "vocab_size": tokenizer.vocab_size}
        model_config = HybridConfig.from_preset(config.preset, **overrides)
    if model_config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"{run_dir}/config.json: the model has {model_config.vocab_size} tokens, the tokenizer "
            f"{tokenizer.vocab_size}"
        )
    tokens = encode_corpus(tokenizer, corpus)
    train_tokens, val_tokens = tokens.train, tokens.val
    for name, toks in (("training", train_tokens), ("validation", val_tokens)):
        if toks.numel() < config.seq_len:
            raise ValueError(
                f"the {name} split of {corpus.source} has {toks.numel()} tokens, fewer than --seq-len {config.seq_len}"
            )
    fingerprint = data_fingerprint(train_tokens, val_tokens)
    if saved is not None:
        check_fingerprint(saved.get("data_fingerprint"), fingerprint, corpus.source, str(run_dir / run_config.CONFIG))
    torch.manual_seed(config.seed)
    backends = dict(kda_backend=config.kda_backend or "auto", attnres_backend=config.attnres_backend or "auto")
    model = HybridLM(model_config, **backends).to(device)
    build = build_optimizers
    if par.sharded:
        distributed.shard_for_training(model, par, config, tokenizer, train_tokens)
        build = distributed.build_optimizers
    optimizers = build(model, optimizer=config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    schedulers = build_schedulers(optimizers, warmup=config.warmup, steps=config.steps, min_ratio=config.min_lr_ratio)
    step = 0
    if saved is not None:
        step = dist_checkpoint.restore_training(run_dir, par, model, optimizers, schedulers)
        if config.stop_after is not None and step < config.steps and config.stop_after <= step:
            raise ValueError(f"--stop-after {config.stop_after}: the run's checkpoint is already at step {step}")
    return Prepared(
        run_dir=run_dir,
        device=device,
        corpus=corpus,
        tokenizer=tokenizer,
        model=model,
        optimizers=optimizers,
        schedulers=schedulers,
        step=step,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
        fingerprint=fingerprint,
        token_cache=tokens.path if tokens.hit else None,
    )
