"""Training: `train(config, resume=...)` runs one job end to end (docs/training.md says how a run is checked,
checkpointed, stopped and resumed); `_train` is the loop over its collaborators: the step, validation, the
checkpointer and the log."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hybrid_attention import files
from hybrid_attention.data.loader import TrainLoader
from hybrid_attention.data.tokenizer import BPE_FILE
from hybrid_attention.device import autocast_for, device_name, flush_denormals
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import run_config
from hybrid_attention.runs.rundir import RunLock
from hybrid_attention.training import distributed
from hybrid_attention.training.checkpointer import Checkpointer
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.interrupts import StopRequests
from hybrid_attention.training.metrics import flops_per_token, peak_flops
from hybrid_attention.training.packed_rows import PackedRows
from hybrid_attention.training.prepare import Prepared, prepare
from hybrid_attention.training.report import epoch_report, is_validation_step, peak_memory
from hybrid_attention.training.reporting import Reporters, scalars
from hybrid_attention.training.step import TrainStep
from hybrid_attention.training.validation import Validation


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
            if resume and p.step >= config.steps:
                echo(
                    f"{run_dir}: the run is complete (step {p.step} of {config.steps}); nothing to do "
                    "(--extend-steps N trains it N steps further)"
                )
                return {"run_dir": str(run_dir), "step": p.step, "steps": config.steps, "already_complete": True}
            rows = ckpt.read_log(run_dir, up_to_step=p.step) if resume else []  # drop rows after the checkpoint
            par.barrier()  # every rank has read the run directory before rank 0 writes to it
            if par.is_main and lock is None:
                run_dir.mkdir(parents=True, exist_ok=True)
                lock = RunLock(run_dir).acquire()
                if ckpt.holds_run(run_dir):  # another job took the directory while this one was preparing
                    raise ValueError(f"--out {run_dir} already holds a run; pass --resume to continue it")
            with contextlib.ExitStack() as job:  # closed before an error reaches the caller: the progress bar too
                return _train(config, p, rows, resume, echo, job.enter_context(StopRequests()), job, par)
    finally:
        if lock is not None:
            lock.release()


def _train(
    config: TrainConfig,
    p: Prepared,
    rows: list[dict],
    resume: bool,
    echo,
    stop: StopRequests,
    job: contextlib.ExitStack,
    par: distributed.Parallel,
) -> dict:
    """The loop: a step, then at log steps a log row, at validation steps a validation and a checkpoint; stops at
    the end, at the time limit or on a signal, always after saving."""
    from tqdm import tqdm

    _write_run_files(config, p, rows, resume, par.is_main)
    autocast = autocast_for(p.device, config.dtype)
    # Rows with their document starts run as packed documents (--doc-mask); without, as plain rows.
    model = PackedRows(torch.compile(p.model) if config.compile else p.model)
    tokens_per_step = config.batch_size * config.seq_len * config.grad_accum  # global: over all ranks
    _announce(config, p, par, echo, tokens_per_step)
    if p.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(p.device)
    eval_model = distributed.RankSlice(model, par) if par.sharded else model
    validation = Validation(eval_model, p, autocast, config, par.is_main)
    loader = TrainLoader(
        p.train_tokens,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        grad_accum=config.grad_accum,
        seed=config.seed,
        rank=par.rank,
        world=par.world_size,
        documents=config.doc_mask,
        pin=p.device.type == "cuda",
    )
    job.callback(loader.close)
    reporters = Reporters(config.report_to if par.is_main else (), p.run_dir, asdict(config), resume=resume)
    job.callback(reporters.close)
    fpt, peak = flops_per_token(p.model, config.seq_len), peak_flops(device_name(p.device))
    peak = peak * par.world_size if peak else None  # all ranks' devices: the tokens per second are all ranks' too
    checkpointer = Checkpointer(p, par, config)
    params = [q for opt in p.optimizers for group in opt.param_groups for q in group["params"]]
    train_step = TrainStep(
        lambda ids, starts=None: model(ids, labels=ids, doc_starts=starts, return_logits=False).loss,
        params,
        p.optimizers,
        grad_accum=config.grad_accum,
        clip=config.clip if config.clip > 0 else math.inf,
        autocast=autocast,
        cuda_graph=config.cuda_graph,
    )
    bar = tqdm(
        total=config.steps,
        initial=p.step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not par.is_main,
    )
    job.callback(bar.close)
    timer = _Throughput()
    end = config.stop_after or config.steps
    deadline = time.perf_counter() + 60 * config.time_limit if config.time_limit else math.inf
    bad_step = torch.zeros((), dtype=torch.long, device=p.device)  # the first step with a non-finite loss or norm
    step, stopped_by = p.step, None
    p.model.train()
    for step in range(p.step + 1, end + 1):
        batch = loader.next(step)  # this rank's share of the global batch, prefetched
        # Under a CUDA graph both live in static buffers that the next step overwrites: read in this iteration only.
        loss_sum, grad_norm = train_step.step(batch.ids.to(p.device, non_blocking=True), batch.doc_starts)
        lr = p.schedulers[-1].get_last_lr()[0]  # the rate this step used
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        bad_step = torch.where(finite | (bad_step > 0), bad_step, step)  # read at the next log or save: no sync here
        for sched in p.schedulers:
            sched.step()
        timer.add(tokens_per_step)
        bar.update(1)
        # All ranks stop together: past the deadline, or a stop signal on any rank (the highest number wins).
        late, stopped_by = _agree(par, stop, time.perf_counter() >= deadline)
        stopping = step == end or late
        do_eval = is_validation_step(step, config.steps, config.eval_every) or stopping
        if not (do_eval or stopped_by or step % config.log_every == 0):
            continue
        if int(bad_step):
            raise checkpointer.diverged(int(bad_step), lr)
        if not (do_eval or step % config.log_every == 0):  # a stop request between log steps: save and stop
            checkpointer.save(step)
            break
        loss_value = float(par.mean(loss_sum))  # synchronises, so the interval time is real
        row = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm)}
        row.update(tokens=step * tokens_per_step, tokens_per_s=timer.interval(logged_before=bool(rows)))
        rows.append(row)
        if do_eval:
            validation(step, row, rows if par.is_main else [], bar.write)
        if par.is_main:
            ckpt.append_log(p.run_dir, row)
            reporters.log(step, scalars(row, device=p.device, flops_per_token=fpt, peak_flops=peak))
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}", refresh=False)
        # A stop requested while this step logged or validated is this step's (every rank logs the same steps).
        stopped_by = stopped_by or _agree(par, stop, False)[1]
        # Step 1 validates early; a checkpoint of it is not worth the write.
        if (do_eval and (step > 1 or stopping)) or stopped_by:
            checkpointer.save(step, validation_finite=validation.finite if do_eval else True)
        if stopping or stopped_by:
            break
        timer.restart()
    bar.close()
    rates = dict(tokens_per_s=timer.mean(), fpt=fpt, peak=peak)
    return _summary(config, p, rows, par, step=step, stopped_by=stopped_by, validation=validation, **rates)


def _write_run_files(config: TrainConfig, p: Prepared, rows: list[dict], resume: bool, main: bool) -> None:
    """From here on the run directory is written (by rank 0; the other ranks write checkpoint shards only): the log
    cut back to the checkpoint on a resume; the settings and the tokenizer for a new run."""
    if not main:
        return
    if resume:
        ckpt.write_log(p.run_dir, rows)
        saved = run_config.load_config(p.run_dir)
        if saved["train"].get("steps") != config.steps:  # --extend-steps: the run's schedule from now on
            run_config.save_config(p.run_dir, {**saved, "train": asdict(config)})
        return
    if p.tokenizer.kind == "bpe":
        files.atomic_write_text(p.run_dir / BPE_FILE, p.tokenizer.to_json())
    run_config.save_config(
        p.run_dir,
        {
            "model": p.model.config.to_dict(),
            "tokenizer": p.tokenizer.to_dict(),
            "train": asdict(config),
            "data_fingerprint": p.fingerprint,
        },
    )


def _announce(config: TrainConfig, p: Prepared, par: distributed.Parallel, echo, tokens_per_step: int) -> None:
    n_train, n_val = p.data.text_bytes
    echo(
        f"data: {p.data.source}: {n_train:,} train / {n_val:,} validation bytes; "
        f"{p.train_tokens.numel():,} / {p.val_tokens.numel():,} {p.tokenizer.kind} tokens"
        + (f" (from the token cache {p.token_cache})" if p.token_cache else "")
        + ("; every document its own sequence (--doc-mask)" if config.doc_mask else "")
    )
    for line in epoch_report(config.steps, tokens_per_step, p.train_tokens.numel()):
        if line:
            echo(line)
    echo(
        f"model: {config.preset}, {p.model.num_parameters():,} parameters, {p.device}, dtype {config.dtype}; "
        f"run directory {p.run_dir}" + (f"; resuming at step {p.step}" if p.step else "")
    )
    notes = []
    if config.activation_checkpointing != "none":
        which = {"mixer": "mixer", "mlp": "MLP", "all": "mixer and MLP"}[config.activation_checkpointing]
        notes.append(f"every {which} recomputed in the backward (--activation-checkpointing)")
    if config.fp8:
        notes.append(f"the large projections in FP8 with {config.fp8} scaling (--fp8)")
    if notes:
        echo("training: " + "; ".join(notes))
    if par.sharded:
        echo(
            f"distributed: {par.world_size} processes, FSDP2 on {p.device.type}; --batch-size {config.batch_size} "
            f"sequences per step in all, {config.batch_size // par.world_size} per process"
        )


def _agree(par: distributed.Parallel, stop: StopRequests, late: bool) -> tuple[bool, str | None]:
    """(late on any rank, the stop signal's name on any rank or None): one small all-reduce."""
    late, signum = par.maxima(late, signal.Signals[stop.signal] if stop.signal else 0)
    return bool(late), signal.Signals(int(signum)).name if signum else None


class _Throughput:
    """Tokens per second between log rows; a process's first interval (compilation, warm-up) is left out of the
    run's mean."""

    def __init__(self):
        self.tick, self.tokens = time.perf_counter(), 0
        self.timed_tokens, self.timed_s = 0, 0.0
        self.last = 0.0  # the latest interval's rate

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def interval(self, *, logged_before: bool) -> float:
        elapsed = time.perf_counter() - self.tick
        if logged_before:
            self.timed_tokens, self.timed_s = self.timed_tokens + self.tokens, self.timed_s + elapsed
        self.last = self.tokens / elapsed
        return self.last

    def restart(self) -> None:
        self.tick, self.tokens = time.perf_counter(), 0

    def mean(self) -> float:
        return self.timed_tokens / self.timed_s if self.timed_s else self.last


def _summary(config, p: Prepared, rows, par, *, step, stopped_by, validation, tokens_per_s, fpt, peak) -> dict:
    """summary.json's contents (written by rank 0); `fpt`, `peak`: FLOPs per token, all ranks' datasheet peak."""
    memory = peak_memory(p.device)
    last = validation.last
    summary = {
        "run_dir": str(p.run_dir),
        "step": step,
        "steps": config.steps,
        "stopped_by": stopped_by,
        "train_loss": rows[-1]["loss"] if rows else None,
        "val_loss": last[0] if last else None,
        "val_bpb": last[1] if last else None,
        "val_windows": config.eval_batches * config.batch_size,  # of seq_len tokens, evenly spaced (data/loader.py)
        "seq_len": config.seq_len,
        "train_eval_loss": rows[-1].get("train_eval_loss") if rows else None,
        "unigram_loss": validation.unigram,
        "unigram_bpb": validation.unigram_bpb,
        "parameters": p.model.num_parameters(),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "mfu": fpt * tokens_per_s / peak if peak else None,  # None: the device's peak is not in metrics' table
        "peak_memory_bytes": memory["allocated"] if memory else None,
        "memory": memory,  # allocated, reserved and the card's total bytes; None off CUDA
        "device": device_name(p.device),
        "torch": torch.__version__,
        "world_size": par.world_size,
    }
    if par.is_main:
        files.atomic_write_text(p.run_dir / ckpt.SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary
