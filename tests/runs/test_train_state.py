"""A training state whose optimizer tensors do not fit the model is refused in one line when the run resumes, not with
a traceback at the first step."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention import cli
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import manifest
from tests.helpers import run_cli

ARGS = ["--steps", 3, "--stop-after", 1, "--batch-size", 1, "--seq-len", 16, "--eval-batches", 1]


@pytest.fixture
def stopped(tmp_path):
    """A run stopped after step 1 of 3, so that --resume trains."""
    data = tmp_path / "data.txt"
    data.write_text("".join(f"x{i} = [{i}, {i + 1}]\n" for i in range(600)))
    assert cli.main([str(a) for a in ["train", "--out", tmp_path / "run", "--data", data, *ARGS]]) == 0
    return tmp_path / "run"


def test_a_wrong_shaped_optimizer_tensor_is_one_line(stopped, capsys):
    key = "exp_avg_sq"
    directory = ckpt.latest_checkpoint(stopped)
    state = torch.load(directory / ckpt.TRAIN_STATE, weights_only=True)
    moments = state["optimizers"][0]["state"]
    index = sorted(moments)[len(moments) // 2]
    shape = tuple(moments[index][key].shape)
    moments[index][key] = torch.zeros(3, 5)
    torch.save(state, directory / ckpt.TRAIN_STATE)
    manifest.add_file(directory, ckpt.TRAIN_STATE)  # a well-formed checkpoint whose state belongs to another model
    code, _, err = run_cli(["train", "--resume", "--out", stopped], capsys)
    message = f"train_state.pt: the AdamW state '{key}' of a parameter of shape {shape} has shape (3, 5)"
    assert code == 1 and "Traceback" not in err and message in err.splitlines()[-1], err
    assert ckpt.checkpoint_step(stopped) == 1
