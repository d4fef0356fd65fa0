"""Sharded checkpoints of distributed runs (torch.distributed.checkpoint, DCP) in the run directory's checkpoint layout,
and their export to one `model.safetensors` (docs/distributed.md, "Checkpoints").
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import torch

from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import manifest, run_config

DCP_METADATA = ".metadata"  # DCP's own index of the shards


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:400]


def is_sharded(directory: str | Path | None) -> bool:
    """Whether a checkpoint directory holds a DCP checkpoint: as its manifest declares, never by the files present.
    A DCP folder without our manifest (written before manifests, or by another program) is refused."""
    if directory is None:
        return False
    kind = manifest.checkpoint_kind(directory)
    if kind is None and (Path(directory) / DCP_METADATA).exists() and not (Path(directory) / ckpt.WEIGHTS).exists():
        raise ValueError(
            f"{directory} holds torch.distributed.checkpoint files but no {manifest.MANIFEST}: it was written by an "
            "older hybrid-attention, whose sharded train state is a pickle, or by another program; it is not read"
        )
    return kind == "sharded"


def save_training(run_dir: str | Path, par, model, optimizers, schedulers, step: int) -> Path:
    """Commit a checkpoint of `step`: DCP shards from every rank when `par` is sharded (a collective call), the
    single-process files (`checkpoint.save_training`) otherwise. Returns the step directory."""
    if not par.sharded:
        return ckpt.save_training(run_dir, model, optimizers, schedulers, step)
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizers)
    state["train"] = _train_state(schedulers, step)

    def write(directory: Path) -> None:
        par.barrier()  # rank 0 has made the fresh directory
        dcp.save(state, checkpoint_id=directory)
        par.barrier()  # every rank's files are complete
        if par.is_main:
            manifest.write_manifest(directory, kind="sharded", step=step)

    final = Path(run_dir) / ckpt.CHECKPOINTS / ckpt.step_dir_name(step)
    if par.is_main:
        final = ckpt.save_checkpoint(run_dir, step, write)
    else:
        write(final.parent / f"{final.name}.tmp")  # the directory save_checkpoint fills on rank 0
    par.barrier()  # committed: no rank goes on (or reads `latest`) before rank 0 has moved the pointer
    return final


def restore_training(run_dir: str | Path, par, model, optimizers, schedulers) -> int:
    """Load the run's newest checkpoint into freshly built objects; returns its step (0 before the first save).

    A sharded checkpoint loads on any number of ranks, or in one process; a single-process checkpoint loads in one
    process (`checkpoint.restore_training`)."""
    directory = ckpt.latest_checkpoint(run_dir)
    if is_sharded(directory):
        return restore(directory, model, optimizers, schedulers)
    if par.sharded and directory is not None:
        raise ValueError(f"{directory} is a single-process checkpoint; continue the run without torchrun")
    return ckpt.restore_training(run_dir, model, optimizers, schedulers)


def _train_state(schedulers, step: int) -> dict:
    """The small, replicated part of the state (DCP saves it from rank 0): JSON in a byte tensor, and torch's RNG."""
    version, internal, gauss = random.getstate()
    body = {"step": step, "schedulers": [s.state_dict() for s in schedulers], "python_rng": [version, internal, gauss]}
    text = json.dumps(body).encode("utf-8")
    return {"state": torch.frombuffer(bytearray(text), dtype=torch.uint8), "rng": torch.get_rng_state()}


def _read_train_state(path: Path, tensors: dict) -> dict:
    """The JSON train state loaded by DCP, checked for its parts."""
    try:
        body = json.loads(tensors["state"].numpy().tobytes().decode("utf-8"))
        ok = isinstance(body, dict) and isinstance(body.get("step"), int) and body["step"] >= 0
        ok = ok and isinstance(body.get("schedulers"), list) and all(isinstance(d, dict) for d in body["schedulers"])
        version, internal, gauss = body["python_rng"]
        python_rng = (version, tuple(internal), gauss)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: the train state is not readable ({type(e).__name__}: {e})") from None
    if not ok:
        raise ValueError(f"{path}: the train state lacks its step or scheduler states")
    body["python_rng"] = python_rng
    return body


def _state(model, optimizers) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd}


def restore(path: str | Path, model, optimizers, schedulers) -> int:
    """Load a sharded checkpoint into a freshly built model (sharded or not) and its optimizers and schedulers.
    Works on any number of ranks, or in a single process. Returns the step."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    manifest.verify(path)  # every rank checks the files it may read
    state = _state(model, optimizers)
    state["train"] = _train_template(path)
    try:
        _load(state, path)
    except Exception as e:  # DCP raises CheckpointException carrying every rank's error
        raise ValueError(f"{path}: the sharded checkpoint does not load into this model ({_one_line(e)})") from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train = _read_train_state(path, state["train"])
    if len(train["schedulers"]) != len(schedulers):
        raise ValueError(f"{path} holds {len(train['schedulers'])} schedulers, expected {len(schedulers)}")
    try:
        for sched, sd in zip(schedulers, train["schedulers"], strict=True):
            sched.load_state_dict(sd)
        torch.set_rng_state(state["train"]["rng"])
        random.setstate(train["python_rng"])
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise ValueError(f"{path}: the train state does not fit this run ({type(e).__name__}: {e})") from None
    return int(train["step"])


def _load(state: dict, path: Path) -> None:
    """dcp.load through the code-free reader and planner (dcp_reader.py); it reads in this process alone when there is
    no process group (and warns that it assumes so)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hybrid_attention.runs.dcp_reader import SafeFileSystemReader, SafeLoadPlanner

    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
        except CheckpointException as e:  # a BaseException carrying each rank's error: the first one says why
            first = next(iter(e.failures.values()), None)
            raise ValueError(_one_line(first[0]) if first else _one_line(e)) from None


def _train_template(path: Path) -> dict:
    """Tensors shaped as the checkpoint's train state (DCP loads into given shapes), sized from its metadata."""
    from hybrid_attention.runs.dcp_reader import SafeFileSystemReader

    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except (ValueError, OSError) as e:
        raise ValueError(f"{path / DCP_METADATA}: {_one_line(e)}") from None
    template = {}
    for name, dtype in (("state", torch.uint8), ("rng", torch.uint8)):
        entry = metadata.state_dict_metadata.get(f"train.{name}")
        if entry is None or not hasattr(entry, "size") or len(entry.size) != 1:
            raise ValueError(f"{path} is not a hybrid-attention sharded checkpoint (no train.{name})")
        template[name] = torch.empty(entry.size, dtype=dtype)
    return template


def needs_export(run_dir: str | Path) -> bool:
    """Whether the run's newest checkpoint is sharded and not yet gathered into model.safetensors."""
    directory = ckpt.latest_checkpoint(run_dir)
    return is_sharded(directory) and ckpt.WEIGHTS not in manifest.read_manifest(directory)["files"]


def export(run_dir: str | Path) -> Path:
    """Gather the model of the run's newest (sharded) checkpoint into `model.safetensors` in its step directory, the
    step in its metadata, readable on one device. Needs no process group; holds the run's lock while it writes.
    Returns the file written."""
    from hybrid_attention.model import HybridLM
    from hybrid_attention.model_size import check_model_fits
    from hybrid_attention.runs.rundir import RunLock

    config = run_config.load_config(run_dir)
    with RunLock(run_dir):
        directory = ckpt.latest_checkpoint(run_dir)
        if directory is None:
            raise ckpt.no_checkpoint_error(run_dir)
        if not is_sharded(directory):
            raise ValueError(f"{directory} is a single-process checkpoint: its {ckpt.WEIGHTS} is read as it is")
        manifest.verify(directory)
        model_config = ckpt.run_model_config(run_dir, config)
        check_model_fits(model_config, "cpu", bytes_per_parameter=4, what=f"gathering the model of {run_dir}")
        model = HybridLM(model_config)
        state = {"model": model.state_dict(), "train": _train_template(directory)}
        try:
            _load(state, directory)
        except Exception as e:
            raise ValueError(f"{directory} does not match the model in {run_config.CONFIG} ({_one_line(e)})") from None
        model.load_state_dict(state["model"])
        step = _read_train_state(directory, state["train"])["step"]
        ckpt.check_finite(model, f"{directory}")
        ckpt.save_weights(directory, model, step)  # in place, then listed: a stop between leaves it unlisted
        manifest.add_file(directory, ckpt.WEIGHTS)
    return directory / ckpt.WEIGHTS
