"""Training on the synthetic tasks: one run (`train_run`), and a grid of runs under a time budget that a rerun continues
(`run_grid`); the grid spec and the log are in docs/fidelity.md, "The synthetic suite".
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hybrid_attention.device import autocast_for, flush_denormals
from hybrid_attention.files import read_json_lines
from hybrid_attention.model import HybridLM
from hybrid_attention.runs.checkpoint import append_log, write_log
from hybrid_attention.synth.models import MODELS, model_config
from hybrid_attention.synth.tasks import TASKS, Task, answer_accuracy
from hybrid_attention.training.optim import build_optimizers, build_schedulers
from hybrid_attention.training.step import TrainStep

LOG = "log.jsonl"


@dataclass(frozen=True)
class RunSpec:
    task: str
    seq_len: int
    model: str
    lr: float
    steps: int

    def key(self) -> tuple:
        return (self.task, self.seq_len, self.model, self.lr, self.steps)


@dataclass
class Settings:
    """What every run of a grid shares."""

    batch_size: int = 64
    num_symbols: int = 64
    mqar_queries: int | None = None  # None: half of the pairs (Task.queries)
    mqar_pairs: int | None = None  # None: a quarter of the sequence (Task.pairs)
    seed: int = 0
    eval_every: int | None = None  # None: a twentieth of the run
    eval_batches: int = 4
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 128
    residual: str = "standard"
    optimizer: str = "adamw"  # or "muon" (hidden matrices), as optim.build_optimizers
    weight_decay: float = 0.1
    clip: float = 1.0
    kda_backend: str = "auto"

    def task(self, name: str, seq_len: int) -> Task:
        """The task `name` at `seq_len` with these settings (the MQAR ones apply to MQAR alone)."""
        if name != "mqar":
            return Task(name, seq_len, self.num_symbols)
        return Task(name, seq_len, self.num_symbols, self.mqar_queries, self.mqar_pairs)


def parse_grid(spec: str, *, steps: int) -> list[tuple[list[str], list[int], list[str], int]]:
    """[(tasks, lengths, models, steps)] from a grid spec, TASKS/LENGTHS/MODELS[/STEPS] cells separated by ";", such
    as "mqar,palindrome/512,1024/kda,gdn,mla/2000;stack/256/kda" (docs/fidelity.md, "The synthetic suite"); `steps`
    where a cell gives none."""
    cells = []
    for text in (c.strip() for c in spec.split(";")):
        if not text:
            continue
        parts = [p.strip() for p in text.split("/")]
        if len(parts) not in (3, 4):
            raise ValueError(f"--grid cell {text!r}: expected TASKS/LENGTHS/MODELS[/STEPS]")
        tasks, models = parts[0].split(","), parts[2].split(",")
        for name, given, known in (("task", tasks, TASKS), ("model", models, MODELS)):
            bad = [g for g in given if g not in known]
            if bad:
                raise ValueError(f"--grid cell {text!r}: unknown {name} {bad[0]!r}; expected one of {', '.join(known)}")
        try:
            lengths = [int(x) for x in parts[1].split(",")]
            cell_steps = int(parts[3]) if len(parts) == 4 else steps
        except ValueError:
            raise ValueError(f"--grid cell {text!r}: LENGTHS and STEPS must be integers") from None
        if min(lengths) < 8 or cell_steps < 1:
            raise ValueError(f"--grid cell {text!r}: lengths must be >= 8 and steps >= 1")
        cells.append((tasks, lengths, models, cell_steps))
    if not cells:
        raise ValueError(f"--grid {spec!r} names no cell")
    return cells


def grid_runs(spec: str, lrs: list[float], *, steps: int) -> list[RunSpec]:
    runs = []
    for tasks, lengths, models, cell_steps in parse_grid(spec, steps=steps):
        for seq_len in lengths:
            for task in tasks:
                for lr in lrs:
                    runs += [RunSpec(task, seq_len, model, lr, cell_steps) for model in models]
    return list(dict.fromkeys(runs))  # a run named by two cells runs once


@torch.no_grad()
def evaluate(model, task: Task, s: Settings, device, autocast) -> float:
    """Answer accuracy over `s.eval_batches` fixed batches of the eval stream."""
    was_training = model.training
    model.eval()
    correct = counted = 0
    for i in range(s.eval_batches):
        x, y = (t.to(device) for t in task.batch(s.batch_size, seed=s.seed, step=i, split="eval"))
        with autocast():
            logits = model(x).logits
        c, n = answer_accuracy(logits, y)
        correct, counted = correct + c, counted + n
    model.train(was_training)
    return correct / max(1, counted)


def train_run(spec: RunSpec, s: Settings, *, device, dtype: str = "auto", log_dir=None, cuda_graph=False) -> dict:
    """Train one model on one task; returns the final row (accuracy, loss, seconds per step, diverged).

    `cuda_graph`: replay each step from a CUDA graph (`train_step.TrainStep`; CUDA only). The models here
    are small enough that an eager step is bound by the host's launches, so a graph runs them several times faster;
    it computes the same steps."""
    task = s.task(spec.task, spec.seq_len)
    config = model_config(
        spec.model,
        task.vocab_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
        head_dim=s.head_dim,
        residual=s.residual,
    )
    torch.manual_seed(s.seed)
    model = HybridLM(config, kda_backend=s.kda_backend).to(device)
    optimizers = build_optimizers(model, optimizer=s.optimizer, lr=spec.lr, weight_decay=s.weight_decay)
    schedulers = build_schedulers(optimizers, warmup=spec.steps // 10, steps=spec.steps, min_ratio=0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = autocast_for(device, dtype)
    # One micro-batch per step, its inputs and labels stacked: [1, 2, B, T].
    loss_of = lambda xy: model(xy[0], labels=xy[1], return_logits=False).loss  # noqa: E731
    train_step = TrainStep(
        loss_of, params, optimizers, clip=s.clip if s.clip > 0 else math.inf, autocast=autocast, cuda_graph=cuda_graph
    )
    eval_every = s.eval_every or max(1, spec.steps // 20)
    base = {**asdict(spec), "seed": s.seed, "batch_size": s.batch_size, "optimizer": s.optimizer, "settings": asdict(s)}
    row, start = None, time.perf_counter()
    model.train()
    with flush_denormals():
        for step in range(1, spec.steps + 1):
            x, y = task.batch(s.batch_size, seed=s.seed, step=step)
            loss, _ = train_step.step(torch.stack([x, y])[None].to(device, non_blocking=True))
            for sched in schedulers:
                sched.step()
            if step % eval_every and step != spec.steps:
                continue
            value = float(loss)  # one sync per evaluation, not per step (a graph's buffer: read before the next)
            diverged = not math.isfinite(value)
            seconds = time.perf_counter() - start
            accuracy = 0.0 if diverged else evaluate(model, task, s, device, autocast)
            row = {
                **base,
                "step": step,
                "loss": value if not diverged else None,
                "accuracy": accuracy,
                "seconds": seconds,
                "s_per_step": seconds / step,
            }
            final = step == spec.steps or diverged
            if final:
                row.update(final=1, diverged=int(diverged))
            if log_dir is not None:
                append_log(log_dir, row)
            if final:
                break
    return row


def read_rows(out: str | Path) -> list[dict]:
    """The rows of OUT/log.jsonl ([] when there is none); a last line cut short by a kill is dropped."""
    return read_json_lines(Path(out) / LOG)


def row_key(row: dict) -> tuple:
    return (row["task"], row["seq_len"], row["model"], row["lr"], row["steps"])


def check_settings(rows: list[dict], s: Settings, out: Path) -> None:
    """Runs found in `out` count as done only if they were trained with the same settings: refuse any other. A
    setting a row does not name (written before the setting existed) had its default."""
    current, defaults = asdict(s), asdict(Settings())
    for row in rows:
        stored = row.get("settings")
        changed = sorted(k for k in current if stored is None or stored.get(k, defaults[k]) != current[k])
        if changed:
            raise ValueError(
                f"{out / LOG} holds runs trained with other settings ({', '.join(changed)}); resume with the same "
                f"settings or write to another --out"
            )


def estimate_seconds(spec: RunSpec, finished: list[dict], batch_size: int) -> float | None:
    """A run's time from the finished ones: the same model and length if any, else the mean seconds per token of
    every finished run scaled to this one (None before the first run finishes)."""
    same = [r["s_per_step"] for r in finished if r["model"] == spec.model and r["seq_len"] == spec.seq_len]
    if same:
        return spec.steps * max(same)
    if not finished:
        return None
    per_token = max(r["s_per_step"] / (r["seq_len"] * r["batch_size"]) for r in finished)
    return spec.steps * per_token * spec.seq_len * batch_size


def run_grid(
    runs: list[RunSpec],
    s: Settings,
    out: str | Path,
    *,
    device,
    dtype="auto",
    budget_s=None,
    echo=print,
    cuda_graph=False,
):
    """Run `runs` in order into `out`; skip finished ones and, past `budget_s` seconds (estimated from the runs
    done so far), the ones that would not fit. Returns (final rows of every finished run, the skipped specs).
    `cuda_graph` as in `train_run` (a speed option: not one of the settings a resumed grid must keep)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(out)
    check_settings(rows, s, out)
    done = {row_key(r) for r in rows if r.get("final")}
    kept = [r for r in rows if row_key(r) in done]
    if len(kept) != len(rows):
        write_log(out, kept)  # rows of runs that were cut off start again
    finished = [r for r in kept if r.get("final")]
    skipped, start = [], time.perf_counter()
    todo = [spec for spec in runs if spec.key() not in done]
    echo(f"synth: {len(runs)} runs, {len(runs) - len(todo)} already in {out / LOG}, {len(todo)} to run")
    for i, spec in enumerate(todo, start=1):
        estimate = estimate_seconds(spec, finished, s.batch_size)
        elapsed = time.perf_counter() - start
        if budget_s is not None and estimate is not None and elapsed + estimate > budget_s:
            skipped.append(spec)
            echo(f"[{i}/{len(todo)}] skip {_name(spec)}: about {estimate:.0f} s, {budget_s - elapsed:.0f} s left")
            continue
        row = train_run(spec, s, device=device, dtype=dtype, log_dir=out, cuda_graph=cuda_graph)
        finished.append(row)
        state = "diverged" if row["diverged"] else f"accuracy {row['accuracy']:.3f}"
        speed = f"{row['s_per_step'] * 1e3:.1f} ms/step"
        echo(f"[{i}/{len(todo)}] {_name(spec)}: {state} in {row['seconds']:.1f} s ({speed})")
    return [r for r in finished if row_key(r) in {spec.key() for spec in runs}], skipped


def _name(spec: RunSpec) -> str:
    return f"{spec.task} T={spec.seq_len} {spec.model} lr={spec.lr:g} {spec.steps} steps"


def best_by_lr(finals: list[dict]) -> dict[tuple, dict]:
    """{(task, seq_len, model): the final row of the learning rate with the highest accuracy (ties: lower loss)}."""
    best = {}
    for r in finals:
        k = (r["task"], r["seq_len"], r["model"])
        score = (r["accuracy"], -(r["loss"] if r["loss"] is not None else math.inf))
        if k not in best or score > best[k][0]:
            best[k] = (score, r)
    return {k: r for k, (_, r) in best.items()}
