"""A full disk at the loss plot: the job warns, goes on and still writes its checkpoint; when the checkpoint cannot be
written either, the one error line says so and names the checkpoint the run keeps."""

from __future__ import annotations

import errno

import pytest

from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.training import validation
from tests.helpers import run_cli

ARGS = ["--steps", 2, "--batch-size", 1, "--seq-len", 16, "--eval-batches", 1, "--eval-every", 1]


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("".join(f"y{i} = {i} ** 2\n" for i in range(800)))
    return path


def test_a_full_disk_at_the_plot_still_checkpoints(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(validation, "plot_losses", full_disk)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--out", out, "--data", data, *ARGS], capsys)
    assert code == 0 and ckpt.checkpoint_step(out) == 2, err
    warning = f"warning: could not write {out / 'loss.png'} ([Errno 28] No space left on device); training goes on"
    assert warning in err and "Traceback" not in err


def test_when_the_checkpoint_fails_too_the_error_says_what_is_kept(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(validation, "plot_losses", full_disk)
    monkeypatch.setattr(ckpt, "save_weights", full_disk)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--out", out, "--data", data, *ARGS], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "could not write loss.png" not in last and "Traceback" not in err, err
    assert last.startswith("hybrid-attention train: error: could not write the checkpoint of step 2 in ")
    assert "No space left on device" in last and last.endswith("the run keeps no checkpoint yet")
