"""Sharded checkpoints of distributed runs (torch.distributed.checkpoint, DCP), and their export to one file.

    run_dir/checkpoints/
      latest              the name of the newest complete checkpoint, e.g. "step_00000400"
      step_00000400/      .metadata + one __R_0.distcp file per rank (model, optimizers, schedulers, RNG, step)

Every rank writes its shards into `step_N.tmp/`; when all have finished (DCP's own gather, then a barrier), rank 0
renames the directory to `step_N` and replaces `latest` (a fsynced file moved with os.replace): that replacement
is the commit, so an interrupted save leaves `latest` naming the previous checkpoint, whole. Older step
directories are removed after the commit.

The state is saved with FQN keys (`get_state_dict`), so it loads on any number of ranks, a single process
included: DCP reads each rank's slices out of whatever shards were written. `export` gathers the model into
`model.safetensors`, the file `generate`, `eval` and `info` read.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import torch

from hybrid_attention import checkpoint as ckpt

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d{8,})")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:400]


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest(run_dir: str | Path) -> Path | None:
    """The directory `checkpoints/latest` names, or None when the run has no sharded checkpoint."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    path = pointer.parent / name
    if not _STEP_DIR.fullmatch(name) or not (path / ".metadata").is_file():
        raise ValueError(f"{pointer} names {name!r}, which is not a complete checkpoint in {pointer.parent}")
    return path


def checkpoint_step(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))


def _train_state(schedulers, step: int) -> dict:
    """The small, replicated part of the state: pickled once into a byte tensor (DCP saves it from rank 0)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    blob = pickle.dumps({"step": step, "schedulers": [s.state_dict() for s in schedulers], "rng": rng})
    return {"blob": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}


def _state(model, optimizers) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd}


def save(run_dir: str | Path, par, model, optimizers, schedulers, step: int) -> Path:
    """Collective: every rank writes its shards of model and optimizer state; rank 0 commits. Returns the step
    directory."""
    import torch.distributed.checkpoint as dcp

    root = Path(run_dir) / CHECKPOINTS
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp"
    if par.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # the leftover of an interrupted save of this step
        tmp.mkdir(parents=True)
    par.barrier()
    state = _state(model, optimizers)
    state["train"] = _train_state(schedulers, step)
    dcp.save(state, checkpoint_id=tmp)
    par.barrier()  # every rank's files are written (and fsynced by DCP's writer)
    if par.is_main:
        _commit(root, tmp, final)
    par.barrier()
    return final


def _commit(root: Path, tmp: Path, final: Path) -> None:
    if final.exists():  # this step was saved before (a resumed run stopped at the same step again)
        shutil.rmtree(final)
    os.replace(tmp, final)
    ckpt.atomic_write_text(root / LATEST, final.name + "\n")  # the commit point
    for entry in root.iterdir():  # older checkpoints and leftovers of interrupted saves
        if entry.is_dir() and entry != final:
            shutil.rmtree(entry, ignore_errors=True)


def restore(path: str | Path, model, optimizers, schedulers) -> int:
    """Load a sharded checkpoint into a freshly built model (sharded or not) and its optimizers and schedulers.
    Works on any number of ranks, or in a single process. Returns the step."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizers)
    state["train"] = {"blob": torch.empty(0, dtype=torch.uint8)}
    _check_blob_size(path, state)
    try:
        _load(state, path)
    except Exception as e:  # DCP raises CheckpointException carrying every rank's error
        raise ValueError(f"{path}: the sharded checkpoint does not load into this model ({_one_line(e)})") from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train = pickle.loads(state["train"]["blob"].numpy().tobytes())
    if len(train["schedulers"]) != len(schedulers):
        raise ValueError(f"{path} holds {len(train['schedulers'])} schedulers, expected {len(schedulers)}")
    for sched, sd in zip(schedulers, train["schedulers"], strict=True):
        sched.load_state_dict(sd)
    torch.set_rng_state(train["rng"]["torch"])
    random.setstate(train["rng"]["python"])
    return int(train["step"])


def _load(state: dict, path: Path) -> None:
    """dcp.load, which reads in this process alone when there is no process group (it warns that it assumes so)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=path)


def _check_blob_size(path, state) -> None:
    """Size the template of the pickled train state from the checkpoint's metadata (DCP loads into given shapes)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    entry = metadata.state_dict_metadata.get("train.blob")
    if entry is None:
        raise ValueError(f"{path} is not a hybrid-attention sharded checkpoint (no train state)")
    state["train"]["blob"] = torch.empty(entry.size, dtype=torch.uint8)


def export(run_dir: str | Path) -> Path:
    """Gather the model of the newest sharded checkpoint into `run_dir/model.safetensors` (the step in its
    metadata), readable on one device. Needs no process group. Returns the file written."""
    from hybrid_attention.model import HybridConfig, HybridLM

    config = ckpt.load_config(run_dir)
    path = latest(run_dir)
    if path is None:
        raise ValueError(f"{run_dir} has no sharded checkpoint ({CHECKPOINTS}/{LATEST} is missing)")
    model = HybridLM(HybridConfig.from_dict(config["model"]))
    state = {"model": model.state_dict()}
    try:
        _load(state, path)
    except Exception as e:
        raise ValueError(f"{path}: the model in {ckpt.CONFIG} does not match the checkpoint ({_one_line(e)})") from None
    model.load_state_dict(state["model"])
    ckpt.save_weights(run_dir, model, checkpoint_step(path))
    return Path(run_dir) / ckpt.WEIGHTS
