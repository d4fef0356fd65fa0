"""The run directory: one writer, divergence stops before saving, the data fingerprint, finished runs left alone,
damaged or hand-edited files refused in one line, the older flat layout still read (checkpoint.py, rundir.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_attention import cli
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import manifest, run_config
from hybrid_attention.runs.rundir import RunLock
from hybrid_attention.training.checkpointer import TrainingDiverged
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.loop import train
from tests.helpers import run_cli

ARGS = ["--steps", 4, "--batch-size", 2, "--seq-len", 32, "--eval-every", 2, "--eval-batches", 1, "--log-every", 1]


def one_line(err: str, message: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err and message in err


def snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(data file, a finished run trained on it)."""
    root = tmp_path_factory.mktemp("rundir")
    data = root / "data.txt"
    data.write_text("".join(f"def g{i}(y):\n    return y - {i}\n\n" for i in range(500)))
    assert cli.main([str(a) for a in ["train", "--out", root / "run", "--data", data, *ARGS]]) == 0
    return data, root / "run"


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run to damage."""
    shutil.copytree(finished[1], tmp_path / "run")
    return tmp_path / "run"


def test_a_second_writer_is_refused_with_the_holders_process_id(run, capsys):
    before = snapshot(run)
    with RunLock(run):
        code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
        holder = f"process {os.getpid()} on {socket.gethostname()}"
        assert code == 1 and one_line(err, f"{run} is in use by another training job ({holder})"), err
    assert snapshot(run) == before
    code, out, _ = run_cli(["train", "--resume", "--out", run], capsys)  # the lock ended with its holder
    assert code == 0 and "the run is complete (step 4 of 4); nothing to do" in out


def test_resuming_a_finished_run_changes_nothing(run, capsys):
    before = snapshot(run)
    code, out, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 0 and out.count("\n") == 1 and "the run is complete" in out, err
    assert snapshot(run) == before


def test_resume_refuses_changed_data(finished, run, capsys):
    data = finished[0]
    saved = data.read_bytes()
    try:
        data.write_bytes(saved.replace(b"return y - 7\n", b"return y + 7\n"))  # same size, other tokens
        code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
        assert code == 1 and one_line(err, "the data changed since the run started"), err
        assert "resume with the same data, or start a new run" in err
    finally:
        data.write_bytes(saved)


def _edit_config(run, edit):
    config = json.loads((run / run_config.CONFIG).read_text())
    edit(config)
    (run / run_config.CONFIG).write_text(json.dumps(config))


HAND_EDITS = [
    (lambda c: c["train"].update(lr="fast"), ["train"], 'train section: lr = "fast"; expected a finite number'),
    (lambda c: c["train"].pop("steps"), ["train"], "train section: missing settings ['steps']"),
    (lambda c: c["train"].pop("batch_size"), ["train", "eval"], "missing settings ['batch_size']"),
    (lambda c: c["model"].update(norm_eps="x"), ["train", "eval", "generate"], 'norm_eps = "x"; expected a finite'),
    (lambda c: c["model"].update(mla_qk_shared_head_dim=True), ["train", "eval"], "mla_qk_shared_head_dim = true;"),
    (lambda c: c["model"].pop("residual"), ["generate"], "model section: missing settings ['residual']"),
    (
        lambda c: c["tokenizer"].update(kind="bpe", file="../../../etc/passwd"),
        ["generate", "train"],
        "tokenizer file '../../../etc/passwd' must be a file inside the run directory",
    ),
    (lambda c: c.update(data_fingerprint="abc"), ["train"], "data_fingerprint is damaged"),
]


@pytest.mark.parametrize("edit, commands, message", HAND_EDITS, ids=[m for _, _, m in HAND_EDITS])
def test_hand_edited_config_is_refused_in_one_line(run, capsys, edit, commands, message):
    _edit_config(run, edit)
    before = snapshot(run)
    argv = {
        "train": ["train", "--resume", "--out", run],
        "eval": ["eval", "--ckpt", run],
        "generate": ["generate", "--ckpt", run, "--prompt", "x"],
    }
    for command in commands:
        code, _, err = run_cli(argv[command], capsys)
        assert code == 1 and one_line(err, message), (command, err)
    assert snapshot(run) == before


def _rewrite_state(run, edit):
    """A well-formed file with wrong content, recorded in the manifest: the content checks must refuse it."""
    directory = ckpt.latest_checkpoint(run)
    state = torch.load(directory / ckpt.TRAIN_STATE, weights_only=True)
    edit(state)
    torch.save(state, directory / ckpt.TRAIN_STATE)
    manifest.write_manifest(directory, kind="single", step=manifest.read_manifest(directory)["step"])


DAMAGE = [
    (lambda r: _rewrite_state(r, lambda s: s.pop("rng")), "is not a training state written by hybrid-attention"),
    (lambda r: _rewrite_state(r, lambda s: s.update(step=3)), "disagree; the checkpoint is damaged"),
    (lambda r: (ckpt.latest_checkpoint(r) / ckpt.TRAIN_STATE).unlink(), "train_state.pt is missing (removed by hand?)"),
    (lambda r: (r / "checkpoints" / "latest").write_text("../../x\n"), "should name a checkpoint like step_00000100"),
    (lambda r: shutil.rmtree(ckpt.latest_checkpoint(r)), "names step_00000004, but"),
    (lambda r: _append_to_log(r, b'{"step": "x"}\n'), "log.jsonl: line 5 is not a log row"),
    (lambda r: _append_to_log(r, b'{"step": 5, "loss": 1\xff}\n'), "log.jsonl: line 5 is not JSON"),
]


def _append_to_log(run, line: bytes):
    with open(run / ckpt.LOG, "ab") as f:
        f.write(line)
    _edit_config(run, lambda c: c["train"].update(steps=6))  # unfinished, so that a resume reads the log


@pytest.mark.parametrize("damage, message", DAMAGE, ids=[m for _, m in DAMAGE])
def test_damaged_run_files_are_refused_in_one_line(run, capsys, damage, message):
    damage(run)
    code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 1 and one_line(err, message), err


def test_a_torn_last_log_line_is_dropped(run):
    rows = ckpt.read_log(run)
    with open(run / ckpt.LOG, "a") as f:
        f.write('{"step": 5, "lo')
    assert ckpt.read_log(run) == rows


def test_flat_layout_runs_are_still_read(run, capsys):
    """Runs saved before checkpoints/ existed: model.safetensors and train_state.pt beside config.json."""
    latest = ckpt.latest_checkpoint(run)
    for name in (ckpt.WEIGHTS, ckpt.TRAIN_STATE):
        shutil.move(latest / name, run / name)
    shutil.rmtree(run / ckpt.CHECKPOINTS)
    assert ckpt.latest_checkpoint(run) == run and ckpt.checkpoint_step(run) == 4
    code, out, err = run_cli(["generate", "--ckpt", run, "--prompt", "def ", "--max-new-tokens", 3], capsys)
    assert code == 0 and out.startswith("def "), err
    (run / ckpt.TRAIN_STATE).unlink()
    code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 1 and one_line(err, "the last save of this older-layout run was interrupted"), err


def test_a_failed_checkpoint_write_keeps_the_last_one(run, monkeypatch):
    """A full disk: torch.save raises RuntimeError; the error names the kept checkpoint, nothing is left behind."""
    before = snapshot(run / ckpt.CHECKPOINTS)

    def disk_full(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\0" * 10)
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", disk_full)
    model = HybridLM(HybridConfig.from_preset("tiny"))
    with pytest.raises(OSError, match=r"could not write the checkpoint of step 9 .* keeps its checkpoint step_0+4$"):
        ckpt.save_training(run, model, [], [], 9)
    assert snapshot(run / ckpt.CHECKPOINTS) == before


def test_divergence_stops_before_saving_and_keeps_the_last_good_checkpoint(finished, tmp_path, monkeypatch):
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def poisoned_at_step_3(params, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            for p in params:
                p.grad.fill_(float("nan"))  # every parameter has a gradient in this model
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned_at_step_3)
    out = tmp_path / "run"
    config = TrainConfig.create(out=str(out), data=str(finished[0]), steps=4, batch_size=2, seq_len=32, eval_every=2,
                                eval_batches=1, log_every=4)  # fmt: skip
    with pytest.raises(TrainingDiverged, match=r"not finite at step 3 .* keeps its checkpoint of step 2; start a new"):
        train(config, echo=lambda *a: None)
    assert ckpt.checkpoint_step(out) == 2 and not (out / ckpt.SUMMARY).exists()
    weights = load_file(ckpt.latest_checkpoint(out) / ckpt.WEIGHTS)
    assert all(torch.isfinite(t).all() for t in weights.values())
    rows = ckpt.read_log(out)  # the early validation at step 1, then the checkpointed step 2; nothing from step 3
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


def test_a_huge_learning_rate_is_one_line_and_exit_1(finished, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--out", out, "--data", finished[0], *ARGS, "--lr", "1e30"], capsys)
    error = err.split("\n")[-2]  # the line after the progress bar
    assert code == 1 and error.startswith("hybrid-attention train: error: training diverged: the loss or the gradient")
    assert "Traceback" not in err
    assert "keeps no checkpoint" in err and ckpt.latest_checkpoint(out) is None


def test_weights_made_nonfinite_by_an_update_are_never_committed(finished, tmp_path, capsys):
    """A decay of 1e30 makes the weights NaN in the update after a finite loss and gradient: the check before the
    commit catches it, and the run keeps no checkpoint of that step."""
    out = tmp_path / "run"
    argv = ["train", "--out", out, "--data", finished[0], *ARGS, "--weight-decay", "1e30", "--lr", "1"]
    code, _, err = run_cli(argv, capsys)
    error = err.split("\n")[-2]
    assert code == 1 and "training diverged: after step 2 the weights hold NaN or infinite values" in error, err
    assert ckpt.latest_checkpoint(out) is None and "keeps no checkpoint" in error


def test_a_removed_latest_pointer_is_recovered_from_the_newest_whole_checkpoint(run, capsys):
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_00000009").mkdir()  # a directory without a manifest is not a checkpoint
    assert ckpt.latest_checkpoint(run) == run / "checkpoints" / "step_00000004"
    code, out, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 0 and "the run is complete (step 4 of 4)" in out, err
    _edit_config(run, lambda c: c["train"].update(steps=6))
    code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 0, err
    assert ckpt.checkpoint_step(run) == 6 and [r["step"] for r in ckpt.read_log(run)][-2:] == [5, 6]


def test_a_failed_removal_of_an_older_checkpoint_warns_and_keeps_training(run, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "step_00000004")

    _edit_config(run, lambda c: c["train"].update(steps=6))
    monkeypatch.setattr(ckpt, "remove_stale", refuse)
    code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 0 and "could not remove an older checkpoint" in err, err
    assert ckpt.checkpoint_step(run) == 6


def test_step_directories_that_are_not_whole_are_refused_not_overwritten(run, capsys):
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_00000004" / manifest.MANIFEST).unlink()
    (run / "checkpoints" / "step_00000004" / ckpt.TRAIN_STATE).unlink()
    before = snapshot(run)
    for argv in (["train", "--resume", "--out", run], ["generate", "--ckpt", run, "--prompt", "x"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 1 and one_line(err, "checkpoints/ holds step_00000004 but none is whole"), err
    assert snapshot(run) == before


def test_execution_choices_stored_by_older_runs_are_ignored_with_a_note(run, capsys):
    """kda_backend and attnres_backend were saved with the model once; they are chosen at load time now."""
    _edit_config(run, lambda c: c["model"].update(kda_backend="fla", attnres_backend="auto"))
    code, _, err = run_cli(["generate", "--ckpt", run, "--prompt", "x", "--max-new-tokens", 2], capsys)
    assert code == 0, err
    assert "note: the stored model config sets kda_backend='fla'" in err and "attnres_backend" not in err
    assert "kda_backend" not in HybridConfig.from_preset("tiny").to_dict()
    code, _, err = run_cli(["generate", "--ckpt", run, "--prompt", "x", "--kda-backend", "nope"], capsys)
    assert code == 2 and "--kda-backend: invalid choice" in err


def test_weights_saved_with_an_attnres_on_the_first_sublayer_load_but_do_not_resume(run, capsys):
    """The first sublayer reads the embedding alone, so the model has no AttnRes there; runs saved when it had one
    store two more tensors: generate and eval skip them, a resume says why it cannot continue."""
    directory = ckpt.latest_checkpoint(run)
    weights = load_file(directory / ckpt.WEIGHTS)
    D = weights["embed.weight"].shape[1]
    extra = {name: torch.randn(D) for name in ckpt.FIRST_SUBLAYER_ATTNRES}
    save_file({**weights, **extra}, directory / ckpt.WEIGHTS, metadata={"step": "4"})
    manifest.write_manifest(directory, kind="single", step=4)
    code, _, err = run_cli(["eval", "--ckpt", run, "--max-batches", 1], capsys)
    assert code == 0, err
    _edit_config(run, lambda c: c["train"].update(steps=6))
    code, _, err = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 1 and one_line(err, "first sublayer still had an AttnRes"), err


def test_the_first_sublayer_has_no_attnres():
    model = HybridLM(HybridConfig.from_preset("tiny"))
    assert not hasattr(model.layers[0], "mixer_res") and hasattr(model.layers[0], "mlp_res")
    assert all(hasattr(layer, "mixer_res") for layer in model.layers[1:])
