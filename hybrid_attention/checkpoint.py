"""Run directories: config.json, model.safetensors, tokenizer.json (BPE only), train_state.pt, log.jsonl, loss.png.

Every file is written atomically: to a temporary file in the same directory, flushed and fsynced, then moved over
the old one with os.replace, so an interrupted write leaves the previous version intact. The weights (safetensors
metadata) and the training state both record their step; a resume checks that they agree, which catches the one
inconsistency atomic files cannot rule out (a stop between the two replacements).
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TRAIN_STATE = "train_state.pt"
LOG = "log.jsonl"
PLOT = "loss.png"
RUN_FILES = (CONFIG, WEIGHTS, TRAIN_STATE, LOG)
FORMAT = "hybrid-attention-run"


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` on a fresh temporary file beside `path`, then move it over `path` (and fsync the
    directory, so that the rename itself survives a crash)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        open(tmp, "xb").close()  # created as open() creates files (umask permissions), unlike mkstemp's 0600
        write(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # POSIX; elsewhere a directory cannot be opened for fsync
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def holds_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` already holds (part of) a run."""
    return any((Path(run_dir) / name).exists() for name in RUN_FILES)


def save_config(run_dir: str | Path, config: dict) -> None:
    atomic_write_text(Path(run_dir) / CONFIG, json.dumps({"format": FORMAT, **config}, indent=2) + "\n")


def load_config(run_dir: str | Path) -> dict:
    """The run's config.json as a dict; ValueError when the directory is not a run."""
    path = Path(run_dir) / CONFIG
    if not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: {CONFIG} is missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f'{path} was not written by hybrid-attention (no "format": "{FORMAT}")')
    for key in ("model", "tokenizer", "train"):
        if not isinstance(config.get(key), dict):
            raise ValueError(f"{path} has no {key!r} section")
    return config


def save_weights(run_dir: str | Path, model: torch.nn.Module, step: int) -> None:
    """model.safetensors with the step in its metadata (shared tensors, e.g. tied embeddings, stored once)."""
    atomic_write(Path(run_dir) / WEIGHTS, lambda tmp: save_model(model, tmp, metadata={"step": str(step)}))


def weights_step(run_dir: str | Path) -> int | None:
    """The step recorded in model.safetensors, or None when there are no weights."""
    path = Path(run_dir) / WEIGHTS
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {}).get("step", -1))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


def load_weights(run_dir: str | Path, model: torch.nn.Module) -> int:
    """Load model.safetensors into `model`, checking names and shapes first. Returns the recorded step."""
    path = Path(run_dir) / WEIGHTS
    if not path.is_file():
        raise ValueError(f"{run_dir}: {WEIGHTS} is missing (the run has not saved a checkpoint yet)")
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
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
    try:
        load_model(model, str(path), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match the model in {CONFIG}: {' '.join(str(e).split())[:400]}") from None
    return weights_step(run_dir)


def save_train_state(run_dir: str | Path, state: dict) -> None:
    atomic_write(Path(run_dir) / TRAIN_STATE, lambda tmp: torch.save(state, tmp))


def load_train_state(run_dir: str | Path) -> dict | None:
    """train_state.pt (optimizer, scheduler, RNG states, step), or None when the run has not saved one yet."""
    path = Path(run_dir) / TRAIN_STATE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise ValueError(f"{path} is not a readable training state ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path} has no step")
    return state


def read_log(run_dir: str | Path, *, up_to_step: int | None = None) -> list[dict]:
    """The JSON lines of log.jsonl, keeping only steps <= `up_to_step` when given."""
    path = Path(run_dir) / LOG
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted append
    return [r for r in rows if isinstance(r, dict) and "step" in r and (up_to_step is None or r["step"] <= up_to_step)]


def write_log(run_dir: str | Path, rows: list[dict]) -> None:
    """Replace log.jsonl with `rows` (used when a resume drops lines logged after its checkpoint)."""
    atomic_write_text(Path(run_dir) / LOG, "".join(json.dumps(r) + "\n" for r in rows))


def append_log(run_dir: str | Path, row: dict) -> None:
    with open(Path(run_dir) / LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def save_training(run_dir: str | Path, model, optimizers, schedulers, step: int) -> None:
    """Weights, then train_state.pt (optimizer and scheduler states, RNG states, step)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "step": step,
        "optimizers": [opt.state_dict() for opt in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "rng": rng,
    }
    save_weights(run_dir, model, step)  # weights first: a stop between the two files is caught by the step check
    save_train_state(run_dir, state)


def restore_training(run_dir: str | Path, model, optimizers, schedulers) -> int:
    """Load what `save_training` wrote into freshly built objects; returns the step (0 if nothing was saved yet)."""
    state = load_train_state(run_dir)
    step = weights_step(run_dir)
    if state is None and step is None:
        return 0  # the run stopped before its first checkpoint: it starts again from its saved settings
    if state is None or step != state["step"]:
        raise ValueError(
            f"{run_dir}: the weights (step {step}) and {TRAIN_STATE} (step {None if state is None else state['step']})"
            " disagree; the last save was interrupted"
        )
    load_weights(run_dir, model)
    if len(state["optimizers"]) != len(optimizers) or len(state["schedulers"]) != len(schedulers):
        raise ValueError(
            f"{run_dir}/{TRAIN_STATE} holds {len(state['optimizers'])} optimizers, expected {len(optimizers)}"
        )
    for opt, sd in zip(optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(sd)
    for sched, sd in zip(schedulers, state["schedulers"], strict=True):
        sched.load_state_dict(sd)
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"].get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])


def load_run(run_dir: str | Path, device: str | torch.device = "cpu", *, weights: bool = True):
    """(model, config dict, tokenizer) of a saved run, the model in eval mode on `device` (float32)."""
    from hybrid_attention.model import HybridConfig, HybridLM
    from hybrid_attention.tokenizer import tokenizer_from_dict

    config = load_config(run_dir)
    try:
        model_config = HybridConfig.from_dict(config["model"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{Path(run_dir) / CONFIG}: invalid model config: {e}") from None
    tokenizer = tokenizer_from_dict(config["tokenizer"], run_dir)
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model {model_config.vocab_size}"
        )
    if not weights:
        with torch.device("meta"):
            return HybridLM(model_config), config, tokenizer
    model = HybridLM(model_config)
    load_weights(run_dir, model)
    return model.to(device).eval(), config, tokenizer
