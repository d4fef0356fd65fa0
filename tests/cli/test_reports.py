"""What the commands report: `train` and `eval --ckpt` name the validation windows and agree on them, messages say
what is meant, and a closed stdout or logits that are not finite end in one line instead of a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys

import pytest
import torch

from hybrid_attention import cli
from hybrid_attention.inference.generate import generate
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import manifest
from tests.helpers import run_cli

ARGS = ["--steps", 2, "--batch-size", 2, "--seq-len", 16, "--eval-batches", 3, "--log-every", 1]


def one_line(code: int, err: str, message: str) -> bool:
    return code == 1 and err.count("\n") == 1 and "Traceback" not in err and message in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, what `train` printed on stdout)."""
    root = tmp_path_factory.mktemp("reports")
    data = root / "data.txt"
    data.write_text("".join(f"class C{i}:\n    value = {i * 7}\n\n" for i in range(400)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([str(a) for a in ["train", "--out", root / "run", "--data", data, *ARGS]]) == 0
    return root / "run", out.getvalue()


@pytest.fixture
def run(trained, tmp_path):
    shutil.copytree(trained[0], tmp_path / "run")
    return tmp_path / "run"


def test_train_and_eval_report_the_same_windows_and_loss(trained, capsys):
    run, printed = trained
    train = re.search(r"validation loss ([\d.]+) nats/token \([\d.]+ bits/byte\) on 6 windows of 16 tokens", printed)
    assert train, printed
    code, out, err = run_cli(["eval", "--ckpt", run], capsys)
    evaluated = re.search(
        r"validation split: 6 windows of 16 tokens evenly spaced over its [\d,]+\): loss ([\d.]+)", out
    )
    assert code == 0 and evaluated, out + err
    assert abs(float(evaluated.group(1)) - float(train.group(1))) <= 1e-4  # the same windows and weights, 4 decimals
    code, out, _ = run_cli(["eval", "--ckpt", run, "--max-batches", 1], capsys)
    assert code == 0 and "validation split: 2 windows of 16 tokens" in out


def test_messages_say_what_is_meant(run, tmp_path, capsys):
    config = json.loads((run / "config.json").read_text())
    config["train"]["data"] = None  # what a run on the built-in corpus stores
    (run / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(["train", "--resume", "--out", run, "--data", tmp_path], capsys)
    assert one_line(code, err, f"--data {tmp_path} (the run has builtin, the default)"), err
    code, _, err = run_cli(["train", "--out", tmp_path / "new", "--lr", "inf"], capsys)
    assert code == 2 and "argument --lr: expected a finite value > 0.0, got inf" in err
    code, out, err = run_cli(["generate", "--ckpt", run, "--prompt", "x", "--max-new-tokens", 0], capsys)
    assert code == 0 and out == "x\n" and err == "[no tokens generated: --max-new-tokens 0]\n"
    code, out, _ = run_cli(["info", "--preset", "tiny"], capsys)
    assert code == 0 and "(bf16 MLA latent rows [c ; k_s], 1 MLA layer)" in out and "3 KDA layers)" in out


def test_generate_with_stdout_closed_is_one_line(run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of a closed descriptor 1 (`>&-`)
    code, _, err = run_cli(["generate", "--ckpt", run, "--prompt", "x"], capsys)
    assert one_line(code, err, "stdout is closed, and generate writes the text there; redirect it (> FILE) instead")


def test_logits_that_are_not_finite_are_one_line(run, capsys):
    model, _, _ = ckpt.load_run(run)
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)  # finite weights whose logits overflow
    directory = ckpt.latest_checkpoint(run)
    ckpt.save_weights(directory, model, ckpt.weights_step(directory))
    manifest.add_file(directory, ckpt.WEIGHTS)
    code, _, err = run_cli(["generate", "--ckpt", run, "--prompt", "def "], capsys)
    assert one_line(code, err, "generate: the logits for new token 1 hold NaN or infinite values"), err
    code, out, err = run_cli(["eval", "--ckpt", run], capsys)
    assert one_line(code, err, "the validation loss on 6 windows of 16 tokens is nan; the weights are unusable"), err
    prompt = torch.tensor([[100, 101]])
    with pytest.raises(ValueError, match="the logits for new token 1 hold NaN or infinite values"):
        generate(model, prompt, 3, temperature=0)  # greedy would otherwise pick a token from NaN
