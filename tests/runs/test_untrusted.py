"""A run directory cannot run code: pickle payloads planted where a checkpoint's files go are never executed by any
command that reads a run (train --resume, export, export --hf, generate, eval, info), and a checkpoint is declared
sharded by its manifest alone."""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import types
from pathlib import Path

import pytest
import torch

from hybrid_attention import cli
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import dist_checkpoint, manifest, run_config
from hybrid_attention.runs.dcp_reader import read_metadata_safely
from hybrid_attention.training.optim import build_optimizers, build_schedulers
from tests.helpers import run_cli

# The sharded copies are written by DCP in this one process, which warns that it assumes so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = ["--steps", 4, "--stop-after", 2, "--batch-size", 2, "--seq-len", 32, "--eval-every", 2, "--eval-batches", 1]


class Payload:
    """Unpickling this creates the directory `marker`: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _commands(run: Path, tmp: Path) -> dict[str, list]:
    commands = {
        "train --resume": ["train", "--resume", "--out", run],
        "export": ["export", "--ckpt", run],
        "export --hf": ["export", "--ckpt", run, "--hf", tmp / "hf"],
        "generate": ["generate", "--ckpt", run, "--prompt", "def ", "--max-new-tokens", 2, "--device", "cpu"],
        "eval": ["eval", "--ckpt", run, "--max-batches", 1, "--device", "cpu"],
        "info": ["info", "--ckpt", run],
    }
    if importlib.util.find_spec("transformers") is None:  # --hf needs the hf extra, which the test extra leaves out
        del commands["export --hf"]
    return commands


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A single-process run stopped at step 2 of 4 (so that a resume reads its checkpoint and goes on)."""
    root = tmp_path_factory.mktemp("untrusted")
    data = root / "data.txt"
    data.write_text("".join(f"def h{i}(z):\n    return z + {i}\n\n" for i in range(400)))
    assert cli.main([str(a) for a in ["train", "--out", root / "run", "--data", data, *ARGS]]) == 0
    return root / "run"


def _sharded_copy(run: Path, dest: Path, *, optim_payload: Payload | None = None) -> Path:
    """`run` with its checkpoint rewritten in the sharded (DCP) format, as a torchrun job writes it; with
    `optim_payload`, one optimizer hyperparameter is replaced by the payload and the manifest re-recorded, as an
    attacker who rewrites the files would."""
    shutil.copytree(run, dest)
    config = run_config.load_config(dest)
    model = HybridLM(HybridConfig.from_dict(config["model"]))
    optimizers = build_optimizers(model, optimizer="adamw", lr=1e-3, weight_decay=0.1)
    schedulers = build_schedulers(optimizers, warmup=1, steps=4, min_ratio=0.1)
    step = ckpt.restore_training(dest, model, optimizers, schedulers)
    shutil.rmtree(dest / ckpt.CHECKPOINTS)
    par = types.SimpleNamespace(sharded=True, is_main=True, barrier=lambda: None)
    state_of = dist_checkpoint._state

    def planted(model, optimizers):
        state = state_of(model, optimizers)
        if optim_payload is not None:
            state["optim"]["param_groups"][0]["lr"] = optim_payload
        return state

    dist_checkpoint._state = planted
    try:
        directory = dist_checkpoint.save_training(dest, par, model, optimizers, schedulers, step)
    finally:
        dist_checkpoint._state = state_of
    assert manifest.checkpoint_kind(directory) == "sharded"
    return dest


def _plant_metadata_in_single(run, marker):
    (ckpt.latest_checkpoint(run) / dist_checkpoint.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))


def _metadata_only(run, marker):
    directory = ckpt.latest_checkpoint(run)
    for path in directory.iterdir():
        path.unlink()
    (directory / dist_checkpoint.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))


def _train_state_payload(run, marker):
    directory = ckpt.latest_checkpoint(run)
    torch.save({"step": 2, "rng": Payload(marker)}, directory / ckpt.TRAIN_STATE)
    manifest.write_manifest(directory, kind="single", step=2)  # re-recorded: the loader itself must refuse it


def _sharded_metadata_payload(run, marker):
    directory = ckpt.latest_checkpoint(run)
    (directory / dist_checkpoint.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    manifest.write_manifest(directory, kind="sharded", step=2)


ALL = {"train --resume", "export", "export --hf", "generate", "eval"}  # info reads config.json and the tokenizer only
# (how the run is prepared, whether it is sharded first, the commands that refuse it in one line; the others work:
# they do not read the planted file, or ignore it). generate and eval refuse a sharded run that is not exported.
PLANTS = {
    ".metadata in a single-process checkpoint": (_plant_metadata_in_single, False, set()),
    ".metadata-only checkpoint": (_metadata_only, False, ALL),
    "pickled object in train_state.pt": (_train_state_payload, False, {"train --resume"}),
    ".metadata of a sharded checkpoint": (_sharded_metadata_payload, True, ALL),
    "optimizer value of a sharded checkpoint": (None, True, {"train --resume", "generate", "eval"}),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_payloads_never_run(stopped, tmp_path, capsys, plant):
    prepare, sharded, refused_by = PLANTS[plant]
    marker = tmp_path / "payload-ran"
    for name, _ in _commands(tmp_path, tmp_path).items():
        case = tmp_path / name.replace(" ", "_").replace("-", "")
        case.mkdir()
        run = case / "run"
        if sharded:
            payload = Payload(marker) if prepare is None else None
            _sharded_copy(stopped, run, optim_payload=payload)
        else:
            shutil.copytree(stopped, run)
        if prepare is not None:
            prepare(run, marker)
        code, _, err = run_cli(_commands(run, case)[name], capsys)
        assert not marker.exists(), f"{plant}: `{name}` ran code from the run directory"
        assert "Traceback" not in err
        if name in refused_by:
            assert code == 1 and err.count("\n") == 1, (name, err)
        else:
            assert code == 0, (name, err)


def test_a_sharded_checkpoint_loads_and_exports(stopped, tmp_path, capsys):
    """The planted-payload cases above are refused for their payload, not because sharded checkpoints never load."""
    run = _sharded_copy(stopped, tmp_path / "run")
    code, out, err = run_cli(["export", "--ckpt", run], capsys)
    assert code == 0, err
    directory = ckpt.latest_checkpoint(run)
    assert manifest.read_manifest(directory)["files"].keys() >= {ckpt.WEIGHTS, ".metadata"}
    model, _, _ = ckpt.load_run(run)
    reference, _, _ = ckpt.load_run(stopped)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    code, out, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 0, err


def test_metadata_reader_refuses_foreign_globals():
    with pytest.raises(ValueError, match="posix.system is not a type checkpoint metadata may hold"):
        read_metadata_safely(b"cposix\nsystem\n(S'true'\ntR.")
    with pytest.raises(ValueError, match="not torch.distributed.checkpoint metadata"):
        read_metadata_safely(pickle.dumps({"a": 1}))


def test_a_flipped_byte_is_caught_before_loading(stopped, tmp_path, capsys):
    for name in (ckpt.WEIGHTS, ckpt.TRAIN_STATE):
        run = tmp_path / name
        shutil.copytree(stopped, run)
        path = ckpt.latest_checkpoint(run) / name
        data = bytearray(path.read_bytes())
        data[len(data) * 3 // 4] ^= 0x01  # inside the tensor data, the header intact
        path.write_bytes(bytes(data))
        command = ["train", "--resume", "--out", run] if name == ckpt.TRAIN_STATE else ["eval", "--ckpt", run]
        code, _, err = run_cli(command, capsys)
        assert code == 1 and f"{name} does not match the checksum its checkpoint recorded" in err, err
