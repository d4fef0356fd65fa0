"""Training: a run's preparation and its loop (the settings, `TrainConfig`, live in `train_config.py`, optimizers in
`optim.py`, FLOPs and evaluation in `metrics.py`, plots in `plots.py`).

`train(config, resume=...)` runs one job end to end and returns a summary dict. Everything that can fail on user
input (flags, data, tokenizer, model config, an occupied run directory, a checkpoint that does not match) is
checked before the first byte is written. The loop is deterministic given the seed: batches come from
`data.sample_batch(seed, step)` and the checkpoint carries optimizer, scheduler and RNG states, so
`--steps N` equals `--stop-after N/2` followed by `--resume` (tested on CPU in float32), and so does a job killed
at any moment and resumed (checkpoints are committed atomically, checkpoint.py). Each optimizer step is a
`train_step.TrainStep`, run eagerly or, with --cuda-graph, replayed from a CUDA graph (docs/training.md).

One job writes a run directory at a time (`rundir.RunLock`). SIGINT or SIGTERM saves a checkpoint after the
current step and stops (`interrupts.StopRequests`). A non-finite loss or gradient norm stops the job with
`TrainingDiverged` before anything is saved from it, so the last checkpoint stays the last good one. A resume
refuses data whose tokens differ from the ones the run started with (`rundir.data_fingerprint`).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hybrid_attention import files
from hybrid_attention.config import HybridConfig
from hybrid_attention.data.batches import check_eval_windows, sample_batch, unigram_loss
from hybrid_attention.data.sources import load_corpus
from hybrid_attention.data.token_cache import encode_corpus
from hybrid_attention.data.tokenizer import (
    BPE_FILE,
    DEFAULT_BPE_VOCAB,
    BPETokenizer,
    ByteTokenizer,
    tokenizer_from_dict,
)
from hybrid_attention.device import autocast_for, flush_denormals, resolve_device, resolve_dtype
from hybrid_attention.machine import check_fits
from hybrid_attention.model import HybridLM
from hybrid_attention.model_size import check_model_fits
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import dist_checkpoint, run_config
from hybrid_attention.runs.rundir import RunLock, check_fingerprint, data_fingerprint
from hybrid_attention.training import distributed
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.interrupts import StopRequests
from hybrid_attention.training.metrics import evaluate, flops_per_token, peak_flops
from hybrid_attention.training.optim import apply_schedule, build_optimizers, build_schedulers
from hybrid_attention.training.plots import plot_losses
from hybrid_attention.training.report import epoch_report, is_validation_step, memory_line, peak_memory, validation_line
from hybrid_attention.training.step import TrainStep


class TrainingDiverged(ValueError):
    """The loss or the gradient norm became NaN or infinite; nothing from that point on was saved."""


# ------------------------------------------------------------------------------------------------------- training
def prepare(config: TrainConfig, *, resume: bool, par: distributed.Parallel | None = None, model_overrides=None):
    """Everything a run needs, checked, before anything is written. Returns a dict of the pieces.

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
    step_ids = config.grad_accum * config.batch_size * config.seq_len  # int64 on the device, stacked for one step
    flags = f"--grad-accum {config.grad_accum:,} x --batch-size {config.batch_size:,} x --seq-len {config.seq_len:,}"
    check_fits(8 * step_ids, f"a step's {step_ids:,} token ids ({flags})", device)
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
    # Lower bounds: float32 weights and gradients, and AdamW's two moments (Muon keeps one for the matrices).
    per_parameter = (16 if config.optimizer == "adamw" else 12) / par.world_size
    check_model_fits(
        model_config, device, bytes_per_parameter=per_parameter, what=f"training the model with {config.optimizer}"
    )
    tokens = encode_corpus(tokenizer, corpus)
    train_tokens, val_tokens = tokens.train, tokens.val
    for name, toks in (("training", train_tokens), ("validation", val_tokens)):
        if toks.numel() < config.seq_len:
            raise ValueError(
                f"the {name} split of {corpus.source} has {toks.numel()} tokens, fewer than --seq-len {config.seq_len}"
            )
        check_eval_windows(toks.numel(), config.batch_size, config.seq_len, config.eval_batches, name, "--eval-batches")
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
    schedule = dict(warmup=config.warmup, steps=config.steps, min_ratio=config.min_lr_ratio, tails=config.extended_at)
    schedulers = build_schedulers(optimizers, **schedule)
    step = 0
    if saved is not None:
        step = dist_checkpoint.restore_training(run_dir, par, model, optimizers, schedulers)
        if saved["train"].get("steps") != config.steps:  # --extend-steps: the next update follows the new tail
            apply_schedule(schedulers)
        if config.stop_after is not None and step < config.steps and config.stop_after <= step:
            raise ValueError(f"--stop-after {config.stop_after}: the run's checkpoint is already at step {step}")
    return dict(run_dir=run_dir, device=device, corpus=corpus, tokenizer=tokenizer, model=model, optimizers=optimizers,
                schedulers=schedulers, step=step, train_tokens=train_tokens, val_tokens=val_tokens,
                fingerprint=fingerprint, token_cache=tokens.path if tokens.hit else None)  # fmt: skip


def train(config: TrainConfig, *, resume: bool = False, echo=print, model_overrides: dict | None = None) -> dict:
    """Run (or continue) a training job; returns a summary (final losses, speed, memory, MFU).

    The summary's "stopped_by" names the signal (e.g. "SIGINT") that stopped the job after saving, else None;
    "already_complete" is True when a resume found the run finished and changed nothing.

    Started by torchrun (`distributed.launched()`), the job is one of several processes training one FSDP2-sharded
    model: every rank returns the summary; rank 0 alone holds the lock, prints and writes the run's plain files.

    `model_overrides` (a new run only): HybridConfig fields over the preset's, e.g. {"mla_output_gate": False}.
    """
    if not distributed.launched():
        return _job(config, resume, echo, distributed.Parallel.single(), model_overrides)
    par = distributed.Parallel.from_env(config.device, config.dist_timeout)
    quiet = lambda *a, **k: None  # noqa: E731
    summary = par.run(lambda: _job(config, resume, echo if par.is_main else quiet, par, model_overrides))
    par.close()
    return summary


def _job(config: TrainConfig, resume: bool, echo, par: distributed.Parallel, model_overrides=None) -> dict:
    run_dir = Path(config.out)
    lock = None
    if par.is_main and run_dir.is_dir():
        lock = RunLock(run_dir).acquire()  # before reading a checkpoint it may be writing
    try:
        with flush_denormals():
            if resume and model_overrides:
                raise ValueError("model_overrides apply to a new run; a resumed run keeps its saved model config")
            p = prepare(config, resume=resume, par=par, model_overrides=model_overrides)
            if resume and p["step"] >= config.steps:
                echo(
                    f"{run_dir}: the run is complete (step {p['step']} of {config.steps}); nothing to do "
                    "(--extend-steps N trains it N steps further)"
                )
                return {"run_dir": str(run_dir), "step": p["step"], "steps": config.steps, "already_complete": True}
            p["rows"] = ckpt.read_log(run_dir, up_to_step=p["step"]) if resume else []  # drop rows after the ckpt
            par.barrier()  # every rank has read the run directory before rank 0 writes to it
            if par.is_main and lock is None:
                run_dir.mkdir(parents=True, exist_ok=True)
                lock = RunLock(run_dir).acquire()
                if ckpt.holds_run(run_dir):  # another job took the directory while this one was preparing
                    raise ValueError(f"--out {run_dir} already holds a run; pass --resume to continue it")
            with contextlib.ExitStack() as job:  # closed before an error reaches the caller: the progress bar too
                return _train(config, p, resume, echo, job.enter_context(StopRequests()), job, par)
    finally:
        if lock is not None:
            lock.release()


def _train(
    config: TrainConfig, p: dict, resume: bool, echo, stop: StopRequests, job: contextlib.ExitStack,
    par: distributed.Parallel,
) -> dict:  # fmt: skip
    from tqdm import tqdm

    run_dir, device, model, tokenizer, start = p["run_dir"], p["device"], p["model"], p["tokenizer"], p["step"]
    optimizers, schedulers, rows, main = p["optimizers"], p["schedulers"], p["rows"], par.is_main
    # ---- from here on, the run directory is written (by rank 0; the other ranks write checkpoint shards only)
    if main and resume:
        ckpt.write_log(run_dir, rows)
        saved = run_config.load_config(run_dir)
        if saved["train"].get("steps") != config.steps:  # --extend-steps: the run's schedule from now on
            run_config.save_config(run_dir, {**saved, "train": asdict(config)})
    elif main:
        if tokenizer.kind == "bpe":
            files.atomic_write_text(run_dir / BPE_FILE, tokenizer.to_json())
        run_config.save_config(
            run_dir,
            {
                "model": model.config.to_dict(),
                "tokenizer": tokenizer.to_dict(),
                "train": asdict(config),
                "data_fingerprint": p["fingerprint"],
            },
        )
    autocast = autocast_for(device, config.dtype)
    step_fn = torch.compile(model) if config.compile else model
    train_tokens, val_tokens = p["train_tokens"], p["val_tokens"]
    unigram = unigram_loss(train_tokens, val_tokens, tokenizer.vocab_size)
    unigram_bpb = unigram * val_tokens.numel() / math.log(2) / int(tokenizer.byte_lengths()[val_tokens.long()].sum())
    byte_lengths = tokenizer.byte_lengths().to(device)
    train_tokens, val_tokens = train_tokens.to(device), val_tokens.to(device)
    tokens_per_step = config.batch_size * config.seq_len * config.grad_accum  # global: over all ranks
    n_train, n_val = p["corpus"].num_bytes
    echo(
        f"data: {p['corpus'].source}: {n_train:,} train / {n_val:,} validation bytes; "
        f"{train_tokens.numel():,} / {val_tokens.numel():,} {tokenizer.kind} tokens"
        + (f" (from the token cache {p['token_cache']})" if p["token_cache"] else "")
    )
    for line in epoch_report(config.steps, tokens_per_step, train_tokens.numel()):
        if line:
            echo(line)
    echo(
        f"model: {config.preset}, {model.num_parameters():,} parameters, {device}, dtype {config.dtype}; "
        f"run directory {run_dir}" + (f"; resuming at step {start}" if start else "")
    )
    if par.sharded:
        echo(
            f"distributed: {par.world_size} processes, FSDP2 on {device.type}; --batch-size {config.batch_size} "
            f"sequences per step in all, {config.batch_size // par.world_size} per process"
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    end = config.stop_after or config.steps
    deadline = time.perf_counter() + 60 * config.time_limit if config.time_limit else math.inf
    params = [q for opt in optimizers for group in opt.param_groups for q in group["params"]]
    clip = config.clip if config.clip > 0 else math.inf
    eval_kw = dict(batch_size=config.batch_size, seq_len=config.seq_len, num_batches=config.eval_batches)
    timed_tokens, timed_s, last_val, step, saved_step, stopped_by = 0, 0.0, None, start, start, None

    def agree(late: bool) -> tuple[bool, str | None]:
        """(late on any rank, the stop signal's name on any rank or None): one small all-reduce."""
        late, signum = par.maxima(late, signal.Signals[stop.signal] if stop.signal else 0)
        return bool(late), signal.Signals(int(signum)).name if signum else None

    memory_shown = False
    bad_step = torch.zeros((), dtype=torch.long, device=device)  # the first step with a non-finite loss or norm
    bar = tqdm(total=config.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0,
               disable=not main)  # fmt: skip
    job.callback(bar.close)
    eval_model = distributed.RankSlice(step_fn, par) if par.sharded else step_fn

    def save(step: int) -> None:
        """Commit a checkpoint of `step`, unless its weights or its validation loss are no longer finite."""
        bad = ckpt.nonfinite_parameters(model)
        val_bad = do_eval and last_val is not None and not math.isfinite(last_val[0])
        if par.maxima(float(bool(bad) or val_bad))[0]:
            what = (
                f"the weights hold NaN or infinite values ({', '.join(bad[:3])})"
                if bad
                else "the validation loss is not finite"
            )
            raise TrainingDiverged(
                f"training diverged: after step {step} {what}; nothing from it was "
                f"saved, {run_dir} keeps "
                + (f"its checkpoint of step {saved_step}" if saved_step else "no checkpoint")
                + f"; start a new run with a lower --lr or --weight-decay (this one has {config.lr:g}, "
                f"{config.weight_decay:g})"
            )
        dist_checkpoint.save_training(run_dir, par, model, optimizers, schedulers, step)

    model.train()
    loss_of = lambda ids: step_fn(ids, labels=ids, return_logits=False).loss  # noqa: E731
    train_step = TrainStep(loss_of, params, optimizers, grad_accum=config.grad_accum, clip=clip, autocast=autocast,
                           cuda_graph=config.cuda_graph)  # fmt: skip
    tick, interval_tokens = time.perf_counter(), 0
    for step in range(start + 1, end + 1):
        batches = torch.stack([
            par.local_rows(sample_batch(train_tokens, config.batch_size, config.seq_len, seed=config.seed, step=step,
                                        micro=micro))  # this rank's share of the global batch
            for micro in range(config.grad_accum)
        ])  # fmt: skip
        # Under a CUDA graph both live in static buffers that the next step overwrites: read in this iteration only.
        loss_sum, grad_norm = train_step.step(batches)  # grad_norm: the same on every rank
        lr = schedulers[-1].get_last_lr()[0]  # the rate this step used
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        bad_step = torch.where(finite | (bad_step > 0), bad_step, step)  # read at the next log or save: no sync here
        for sched in schedulers:
            sched.step()
        interval_tokens += tokens_per_step
        bar.update(1)
        # All ranks stop together: past the deadline, or a stop signal on any rank (the highest number wins).
        late, stopped_by = agree(time.perf_counter() >= deadline)
        stopping = step == end or late
        do_eval = is_validation_step(step, config.steps, config.eval_every) or stopping
        if not (do_eval or stopped_by or step % config.log_every == 0):
            continue
        if int(bad_step):
            raise TrainingDiverged(
                f"training diverged: the loss or the gradient norm is not finite at step {int(bad_step)} (learning "
                f"rate {lr:.3g}); nothing from it was saved, {run_dir} keeps "
                + (f"its checkpoint of step {saved_step}" if saved_step else "no checkpoint")
                + f"; start a new run with a lower --lr (this one has {config.lr:g})"
            )
        if not (do_eval or step % config.log_every == 0):  # a stop request between log steps: save and stop
            save(step)
            break
        loss_value = float(par.mean(loss_sum))  # synchronises, so the interval time below is real
        elapsed = time.perf_counter() - tick
        row = {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": step * tokens_per_step,
            "tokens_per_s": interval_tokens / elapsed,
        }
        if rows and rows[-1]["step"] > start:  # a process's first interval holds compilation and warm-up
            timed_tokens, timed_s = timed_tokens + interval_tokens, timed_s + elapsed
        if do_eval:
            last_val = evaluate(eval_model, val_tokens, byte_lengths, autocast=autocast, **eval_kw)
            row["val_loss"], row["val_bpb"] = last_val
            row["train_eval_loss"] = evaluate(eval_model, train_tokens, byte_lengths, autocast=autocast, **eval_kw)[0]
        rows.append(row)
        if main:
            ckpt.append_log(run_dir, row)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}", refresh=False)
        if do_eval:
            bar.write(validation_line(step, row["train_eval_loss"], *last_val, unigram))
            if not memory_shown and (memory := peak_memory(device)):  # does the batch fit: known after one step
                bar.write(memory_line(torch.cuda.get_device_name(device), memory))
                memory_shown = True
            if main:
                try:
                    plot_losses(run_dir, rows)
                except OSError as e:  # a picture of log.jsonl: never worth the checkpoint that follows
                    bar.write(
                        f"warning: could not write {run_dir / ckpt.PLOT} ({e}); training goes on", file=sys.stderr
                    )
        # A stop requested while this step logged or validated is this step's (every rank logs the same steps).
        stopped_by = stopped_by or agree(False)[1]
        # Step 1 validates early; a checkpoint of it is not worth the write.
        if (do_eval and (step > 1 or stopping)) or stopped_by:
            save(step)
            saved_step = step
        if stopping or stopped_by:
            break
        tick, interval_tokens = time.perf_counter(), 0
    bar.close()
    tokens_per_s = timed_tokens / timed_s if timed_s else (rows[-1]["tokens_per_s"] if rows else 0.0)
    fpt = flops_per_token(model, config.seq_len)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    memory = peak_memory(device)
    peak = peak_flops(device_name)
    summary = {
        "run_dir": str(run_dir),
        "step": step,
        "steps": config.steps,
        "stopped_by": stopped_by,
        "train_loss": rows[-1]["loss"] if rows else None,
        "val_loss": last_val[0] if last_val else None,
        "val_bpb": last_val[1] if last_val else None,
        "val_windows": config.eval_batches * config.batch_size,  # of seq_len tokens, evenly spaced (data/batches.py)
        "seq_len": config.seq_len,
        "train_eval_loss": rows[-1].get("train_eval_loss") if rows else None,
        "unigram_loss": unigram,
        "unigram_bpb": unigram_bpb,
        "parameters": model.num_parameters(),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        # None: the device's peak is not in metrics' table. The tokens are all ranks', the peak one device's.
        "mfu": fpt * tokens_per_s / (peak * par.world_size) if peak else None,
        "peak_memory_bytes": memory["allocated"] if memory else None,
        "memory": memory,  # allocated, reserved and the card's total bytes; None off CUDA
        "device": device_name,
        "torch": torch.__version__,
        "world_size": par.world_size,
    }
    if main:
        files.atomic_write_text(run_dir / ckpt.SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary
