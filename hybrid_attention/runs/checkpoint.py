"""Run directories: the files of a run and its checkpoints, each checkpoint written whole and committed by one pointer
file (docs/training.md, "Run directories and checkpoints").
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from hybrid_attention.files import atomic_write, atomic_write_text, default_permissions, fsync, read_json_lines
from hybrid_attention.runs import manifest
from hybrid_attention.runs.run_config import CONFIG, load_config

WEIGHTS = "model.safetensors"
TRAIN_STATE = "train_state.pt"
LOG = "log.jsonl"
PLOT = "loss.png"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d{8,})")


# ----------------------------------------------------------------------------------------------------- checkpoints
def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The directory of the run's newest complete checkpoint (the one `checkpoints/latest` names), the run directory
    itself for the older flat layout, or None before the first checkpoint. ValueError for a damaged pointer."""
    run_dir = Path(run_dir)
    pointer = run_dir / CHECKPOINTS / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{pointer} is not readable ({e})") from None
        directory = run_dir / CHECKPOINTS / name
        if not _STEP_DIR.fullmatch(name):
            raise ValueError(f"{pointer} should name a checkpoint like step_00000100, but holds {name[:40]!r}")
        if not directory.is_dir():
            raise ValueError(f"{pointer} names {name}, but {directory} is missing (removed by hand?)")
        return directory
    if (run_dir / WEIGHTS).is_file() or (run_dir / TRAIN_STATE).is_file():
        return run_dir
    return _newest_complete(run_dir / CHECKPOINTS)


def _newest_complete(root: Path) -> Path | None:
    """Without a `latest` pointer (removed by hand), the newest step directory that is whole: its manifest declares
    the step its name says (a directory gets its final name only once its files are written and fsynced)."""
    if not root.is_dir():
        return None
    steps = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))),
        reverse=True,
    )
    for step, directory in steps:
        try:
            body = manifest.read_manifest(directory)
        except ValueError:
            continue
        if body is not None and body["step"] == step:
            return directory
        if body is None and (directory / WEIGHTS).is_file() and (directory / TRAIN_STATE).is_file():
            return directory  # written before manifests
    return None


def step_directories(run_dir: str | Path) -> list[str]:
    """Names of the step directories under checkpoints/, whole or not."""
    root = Path(run_dir) / CHECKPOINTS
    return sorted(p.name for p in root.iterdir() if _STEP_DIR.fullmatch(p.name)) if root.is_dir() else []


def no_checkpoint_error(run_dir: str | Path) -> ValueError:
    """The error for a run without a usable checkpoint, saying what its checkpoints/ folder holds."""
    found = step_directories(run_dir)
    if not found:
        return ValueError(f"{run_dir}: the run has not saved a checkpoint yet")
    return ValueError(
        f"{run_dir}: checkpoints/ holds {', '.join(found[-3:])} but none is whole (its checkpoint.json or a file is "
        "missing); nothing can be loaded from it: move it away to start the run again"
    )


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """A fresh, empty temporary directory for the checkpoint of `step` (checkpoints/step_N.tmp: one name every
    process of a distributed job can compute). A leftover of an interrupted save of the same step is removed."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    current = latest_checkpoint(run_dir)
    if current is not None and current.name == step_dir_name(step):
        raise ValueError(f"{current} is already the run's latest checkpoint")
    tmp = root / f"{step_dir_name(step)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit_checkpoint(run_dir: str | Path, step: int) -> Path:
    """Make the filled temporary directory of `step` the run's latest checkpoint: fsync its files, rename it to
    checkpoints/step_N, replace checkpoints/latest (the commit point), remove what that makes obsolete."""
    root = Path(run_dir) / CHECKPOINTS
    name = step_dir_name(step)
    final, tmp = root / name, root / f"{name}.tmp"
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            default_permissions(path)
            fsync(path)
    fsync(tmp, directory=True)
    if final.exists():  # renamed into place but never committed: a stop came before the pointer moved
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync(root, directory=True)
    atomic_write_text(root / LATEST, name + "\n")
    try:
        remove_stale(run_dir)
    except OSError as e:  # the new checkpoint is committed: a leftover costs disk space, not the run
        print(
            f"warning: saved {final}, but could not remove an older checkpoint ({e}); remove it by hand",
            file=sys.stderr,
        )
    return final


def save_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], None]) -> Path:
    """`begin_checkpoint`, `write(directory)` to fill it, `commit_checkpoint`; returns the checkpoint's directory.
    A failed write removes the temporary directory and raises OSError naming the checkpoint the run keeps."""
    current = latest_checkpoint(run_dir)
    tmp = begin_checkpoint(run_dir, step)
    try:
        write(tmp)
        return commit_checkpoint(run_dir, step)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (OSError, RuntimeError, SafetensorError)):  # torch.save reports a full disk as such
            raise
        kept = f"its checkpoint {latest_checkpoint(run_dir).name}" if current is not None else "no checkpoint yet"
        detail = " ".join(str(e).split())[:200]
        raise OSError(
            f"could not write the checkpoint of step {step} in {tmp.parent} ({detail}); the run keeps {kept}"
        ) from e


def remove_stale(run_dir: str | Path) -> None:
    """Remove what the committed checkpoint makes obsolete: other step directories, temporaries of interrupted
    writes, and the files of the older flat layout. Only the job holding the run's lock may call this."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    current = latest_checkpoint(run_dir)
    keep = current.name if current is not None and current.parent == root else None
    if root.is_dir():
        for path in root.iterdir():
            stale = path.name.endswith(".tmp") or _STEP_DIR.fullmatch(path.name)
            if stale and path.name != keep:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    leftovers = [p for p in run_dir.glob(".*.tmp") if p.is_file()]
    if keep is not None:
        leftovers += [run_dir / WEIGHTS, run_dir / TRAIN_STATE]
    for path in leftovers:
        path.unlink(missing_ok=True)


def holds_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a run worth keeping: a checkpoint or logged steps (a directory left with only the
    settings of a job that failed before its first log line may be reused)."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINTS).is_dir() or (run_dir / WEIGHTS).exists() or (run_dir / TRAIN_STATE).exists():
        return True
    log = run_dir / LOG
    return log.is_file() and log.stat().st_size > 0


# ------------------------------------------------------------------------------------------ weights, train state
def save_weights(directory: str | Path, model: torch.nn.Module, step: int) -> None:
    """directory/model.safetensors with the step in its metadata (shared tensors, e.g. tied embeddings, stored
    once), written whole or not at all."""
    atomic_write(Path(directory) / WEIGHTS, lambda tmp: save_model(model, tmp, metadata={"step": str(step)}))


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or an infinity (this process's shards of sharded ones); one sync."""
    named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in model.named_parameters()]
    if not named:
        return []
    flags = torch.stack([p.detach().isfinite().all() for _, p in named]).tolist()
    return [n for (n, _), ok in zip(named, flags, strict=True) if not ok]


def check_finite(model: torch.nn.Module, where: str) -> None:
    """ValueError naming the first parameters that hold NaN or infinite values."""
    bad = nonfinite_parameters(model)
    if bad:
        raise ValueError(
            f"{where}: {len(bad)} parameter tensors hold NaN or infinite values ({', '.join(bad[:3])}); the weights "
            "are unusable (a run that diverged, or a damaged file)"
        )


def weights_step(directory: str | Path) -> int | None:
    """The step recorded in directory/model.safetensors, or None when there are no weights."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            step = (f.metadata() or {}).get("step")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    if step is None or not step.isdigit():
        raise ValueError(f"{path} records no training step in its metadata (step = {step!r})")
    return int(step)


# The first sublayer reads the embedding alone, where an AttnRes is the identity, so the model has none there; runs
# saved when it still had one store its two tensors, which loading skips.
FIRST_SUBLAYER_ATTNRES = ("layers.0.mixer_res.query", "layers.0.mixer_res.key_norm.weight")


def load_weights(directory: str | Path, model: torch.nn.Module, *, resuming: bool = False) -> int:
    """Load directory/model.safetensors into `model`, checking names and shapes first. Returns the recorded step.
    `resuming`: the optimizer state follows (a run that stored `FIRST_SUBLAYER_ATTNRES` cannot continue training)."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise ValueError(f"{directory}: {WEIGHTS} is missing")
    manifest.verify(directory, [WEIGHTS])
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    skipped = [name for name in FIRST_SUBLAYER_ATTNRES if name in stored and name not in expected]
    if skipped and resuming:
        raise ValueError(
            f"{path} was saved when the first sublayer still had an AttnRes (the identity, since it reads the "
            "embedding alone); its weights load for generate, eval and export, but its optimizer state does not fit "
            "this version's model: start a new run"
        )
    for name in skipped:
        del stored[name]
    unknown = sorted(set(stored) - set(expected))
    missing = sorted(set(expected) - set(stored))
    common = sorted(set(stored) & set(expected))
    wrong = [f"{n} {stored[n]} vs {expected[n]}" for n in common if stored[n] != expected[n]]
    if unknown or missing or wrong:
        detail = "; ".join(
            ([f"unexpected tensors {unknown[:3]}"] if unknown else [])
            + ([f"missing tensors {missing[:3]}"] if missing else [])
            + wrong[:3]
        )
        raise ValueError(f"{path} does not match the model in {CONFIG}: {detail}")
    device = next(model.parameters()).device  # straight to the model's device, no host copy
    try:  # the names were checked above: not strict only to pass over the `skipped` tensors
        load_model(model, str(path), strict=not skipped, device=str(device))
    except RuntimeError as e:
        raise ValueError(f"{path} does not match the model in {CONFIG}: {' '.join(str(e).split())[:400]}") from None
    check_finite(model, str(path))
    return weights_step(directory)


def save_train_state(directory: str | Path, state: dict) -> None:
    torch.save(state, Path(directory) / TRAIN_STATE)


def load_train_state(directory: str | Path) -> dict | None:
    """directory/train_state.pt (optimizer, scheduler, RNG states, step) checked for its parts, or None when absent."""
    path = Path(directory) / TRAIN_STATE
    if not path.is_file():
        return None
    manifest.verify(directory, [TRAIN_STATE])
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise ValueError(f"{path} is not a readable training state ({type(e).__name__}: {e})") from None
    problem = None
    if not isinstance(state, dict):
        problem = f"holds a {type(state).__name__}, not a dict"
    elif not isinstance(state.get("step"), int) or state["step"] < 0:
        problem = f"step = {state.get('step')!r}; expected an integer >= 0"
    elif not all(isinstance(state.get(k), list) and all(isinstance(d, dict) for d in state[k]) for k in _STATE_LISTS):
        problem = "optimizers and schedulers must be lists of state dicts"
    elif not isinstance(state.get("rng"), dict) or not isinstance(state["rng"].get("torch"), torch.Tensor):
        problem = "no RNG states (rng.torch)"
    elif not isinstance(state["rng"].get("python"), tuple):
        problem = "no Python RNG state (rng.python)"
    if problem:
        raise ValueError(f"{path} is not a training state written by hybrid-attention: {problem}")
    return state


_STATE_LISTS = ("optimizers", "schedulers")


def save_training(run_dir: str | Path, model, optimizers, schedulers, step: int) -> Path:
    """Commit a checkpoint of `step`: the weights and train_state.pt (optimizer and scheduler states, RNG states)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "step": step,
        "optimizers": [opt.state_dict() for opt in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "rng": rng,
    }

    def write(directory: Path) -> None:
        save_weights(directory, model, step)
        save_train_state(directory, state)
        manifest.write_manifest(directory, kind="single", step=step)

    return save_checkpoint(run_dir, step, write)


def checkpoint_step(run_dir: str | Path) -> int:
    """The step of the run's newest complete checkpoint (0 before the first)."""
    directory = latest_checkpoint(run_dir)
    return 0 if directory is None else weights_step(directory) or 0


def restore_training(run_dir: str | Path, model, optimizers, schedulers) -> int:
    """Load the newest complete checkpoint into freshly built objects; returns its step (0 if none was saved yet)."""
    directory = latest_checkpoint(run_dir)
    if directory is None and step_directories(run_dir):
        raise no_checkpoint_error(run_dir)  # never start over on top of step directories nothing supersedes yet
    if directory is None:
        return 0  # the run stopped before its first checkpoint: it starts again from its saved settings
    state, step = load_train_state(directory), weights_step(directory)
    flat = directory == Path(run_dir)
    for name, value in ((TRAIN_STATE, state), (WEIGHTS, step)):
        if value is None:
            why = "the last save of this older-layout run was interrupted" if flat else "removed by hand?"
            raise ValueError(f"{directory}: {name} is missing ({why})")
    if step != state["step"]:
        why = "the last save of this older-layout run was interrupted" if flat else "the checkpoint is damaged"
        raise ValueError(
            f"{directory}: the weights (step {step}) and {TRAIN_STATE} (step {state['step']}) disagree; {why}"
        )
    load_weights(directory, model, resuming=True)
    if len(state["optimizers"]) != len(optimizers) or len(state["schedulers"]) != len(schedulers):
        raise ValueError(
            f"{directory / TRAIN_STATE} holds {len(state['optimizers'])} optimizers and {len(state['schedulers'])} "
            f"schedulers, expected {len(optimizers)} and {len(schedulers)}"
        )
    try:
        for opt, sd in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(sd)
        for sched, sd in zip(schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sd)
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"].get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise ValueError(f"{directory / TRAIN_STATE} does not fit this run ({type(e).__name__}: {e})") from None
    check_state_shapes(optimizers, directory / TRAIN_STATE)
    return int(state["step"])


def check_state_shapes(optimizers, where) -> None:
    """ValueError naming the first optimizer state tensor (a moment, a momentum) whose shape is not its parameter's:
    `load_state_dict` takes any shape, and the first step would then fail."""
    for opt in optimizers:
        for p in (p for group in opt.param_groups for p in group["params"]):
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"{where}: the {type(opt).__name__} state {key!r} of a parameter of shape {tuple(p.shape)} "
                        f"has shape {tuple(value.shape)}; the training state is damaged or from another model"
                    )


# ------------------------------------------------------------------------------------------------------ log.jsonl
def read_log(run_dir: str | Path, *, up_to_step: int | None = None) -> list[dict]:
    """The rows of log.jsonl, keeping only steps <= `up_to_step` when given. A last line without its newline (an
    append cut short) is dropped; any other line that is not a JSON object with an integer step and finite numbers
    raises ValueError naming the file and line."""
    path = Path(run_dir) / LOG
    rows = []
    for number, row in enumerate(read_json_lines(path), start=1):
        ok = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
        ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row.values())
        if not ok:
            raise ValueError(f"{path}: line {number} is not a log row (a JSON object of numbers with an integer step)")
        rows.append(row)
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


def write_log(run_dir: str | Path, rows: list[dict]) -> None:
    """Replace log.jsonl with `rows` (used when a resume drops lines logged after its checkpoint)."""
    atomic_write_text(Path(run_dir) / LOG, "".join(json.dumps(r) + "\n" for r in rows))


def append_log(run_dir: str | Path, row: dict) -> None:
    with open(Path(run_dir) / LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------------------- reading
def run_model_config(run_dir: str | Path, config: dict | None = None):
    """The `HybridConfig` of a saved run (from `config`, its config.json already read, or read here)."""
    from hybrid_attention.config import HybridConfig

    config = load_config(run_dir) if config is None else config
    try:
        return HybridConfig.from_dict(config["model"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{Path(run_dir) / CONFIG}: invalid model config: {e}") from None


def load_run(
    run_dir: str | Path,
    device: str | torch.device = "cpu",
    *,
    weights: bool = True,
    kda_backend: str = "auto",
    attnres_backend: str = "auto",
):
    """(model, config dict, tokenizer) of a saved run, the model in eval mode on `device` (float32), with the
    weights of its newest complete checkpoint; the backends choose its kernels (`HybridLM`)."""
    from hybrid_attention.data.tokenizer import tokenizer_from_dict
    from hybrid_attention.model import HybridLM
    from hybrid_attention.model_size import check_model_fits

    config = load_config(run_dir)
    model_config = run_model_config(run_dir, config)
    tokenizer = tokenizer_from_dict(config["tokenizer"], run_dir)
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model {model_config.vocab_size}"
        )
    if not weights:
        with torch.device("meta"):
            return HybridLM(model_config, kda_backend=kda_backend, attnres_backend=attnres_backend), config, tokenizer
    directory = latest_checkpoint(run_dir)
    if directory is None:
        raise no_checkpoint_error(run_dir)
    body = manifest.read_manifest(directory)
    if body is not None and body["kind"] == "sharded" and WEIGHTS not in body["files"]:
        raise ValueError(
            f"{directory} is sharded (a torchrun run); gather it with `hybrid-attention export --ckpt {run_dir}`"
        )
    check_model_fits(model_config, device, bytes_per_parameter=4, what=f"loading the model of {run_dir} in float32")
    with torch.device(device):  # the random initialisation the weights replace runs where it is cheap
        model = HybridLM(model_config, kda_backend=kda_backend, attnres_backend=attnres_backend)
    load_weights(directory, model)
    return model.eval(), config, tokenizer
