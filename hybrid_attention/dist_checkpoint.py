"""Sharded checkpoints of distributed runs (torch.distributed.checkpoint, DCP), and their export to one file.

They use the run directory's checkpoint layout (checkpoint.py): a step directory committed by the `latest` pointer.

    run_dir/checkpoints/
      latest              the name of the newest complete checkpoint, e.g. "step_00000400"
      step_00000400/      .metadata + one __R_0.distcp file per rank (model, optimizers, schedulers, RNG, step)
                          (+ model.safetensors once `hybrid-attention export` has run)

Rank 0 runs `checkpoint.save_checkpoint`, whose `write(directory)` is the collective DCP save: every rank writes its
shards into the temporary `step_N.tmp/`; when all have finished, rank 0 fsyncs, renames the directory to `step_N`
and replaces `latest`. That replacement is the commit, so an interrupted save leaves the previous checkpoint whole,
on every rank at once: there is one pointer.

The state is saved with FQN keys (`get_state_dict`), so it loads on any number of ranks, a single process
included: DCP reads each rank's slices out of whatever shards were written. `export` gathers the model into
`model.safetensors` in the step directory, the file `generate`, `eval` and `info` read.
"""

from __future__ import annotations

import pickle
import random
import warnings
from pathlib import Path

import torch

from hybrid_attention import checkpoint as ckpt
from hybrid_attention import run_config

METADATA = ".metadata"  # written by DCP's coordinator last: its presence marks a sharded checkpoint


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:400]


def is_sharded(directory: str | Path | None) -> bool:
    """Whether a checkpoint directory holds a DCP checkpoint."""
    return directory is not None and (Path(directory) / METADATA).is_file()


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
    """The small, replicated part of the state: pickled once into a byte tensor (DCP saves it from rank 0)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    blob = pickle.dumps({"step": step, "schedulers": [s.state_dict() for s in schedulers], "rng": rng})
    return {"blob": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}


def _state(model, optimizers) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd}


def restore(path: str | Path, model, optimizers, schedulers) -> int:
    """Load a sharded checkpoint into a freshly built model (sharded or not) and its optimizers and schedulers.
    Works on any number of ranks, or in a single process. Returns the step."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizers)
    state["train"] = {"blob": torch.empty(0, dtype=torch.uint8)}
    _size_blob(path, state)
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


def _size_blob(path, state) -> None:
    """Size the template of the pickled train state from the checkpoint's metadata (DCP loads into given shapes)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    entry = metadata.state_dict_metadata.get("train.blob")
    if entry is None:
        raise ValueError(f"{path} is not a hybrid-attention sharded checkpoint (no train state)")
    state["train"]["blob"] = torch.empty(entry.size, dtype=torch.uint8)


def needs_export(run_dir: str | Path) -> bool:
    """Whether the run's newest checkpoint is sharded and not yet gathered into model.safetensors."""
    directory = ckpt.latest_checkpoint(run_dir)
    return is_sharded(directory) and not (directory / ckpt.WEIGHTS).is_file()


def export(run_dir: str | Path) -> Path:
    """Gather the model of the run's newest (sharded) checkpoint into `model.safetensors` in its step directory, the
    step in its metadata, readable on one device. Needs no process group; holds the run's lock while it writes.
    Returns the file written."""
    from hybrid_attention.model import HybridConfig, HybridLM
    from hybrid_attention.rundir import RunLock

    config = run_config.load_config(run_dir)
    with RunLock(run_dir):
        directory = ckpt.latest_checkpoint(run_dir)
        if directory is None:
            raise ValueError(f"{run_dir} has no checkpoint yet")
        if not is_sharded(directory):
            raise ValueError(f"{directory} is a single-process checkpoint: its {ckpt.WEIGHTS} is read as it is")
        model = HybridLM(HybridConfig.from_dict(config["model"]))
        state = {"model": model.state_dict(), "train": {"blob": torch.empty(0, dtype=torch.uint8)}}
        _size_blob(directory, state)
        try:
            _load(state, directory)
        except Exception as e:
            raise ValueError(f"{directory} does not match the model in {run_config.CONFIG} ({_one_line(e)})") from None
        model.load_state_dict(state["model"])
        step = pickle.loads(state["train"]["blob"].numpy().tobytes())["step"]
        ckpt.save_weights(directory, model, step)
    return directory / ckpt.WEIGHTS
