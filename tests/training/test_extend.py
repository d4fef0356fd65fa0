"""`train --resume --extend-steps N`: a finished run trains N steps further on a new learning-rate tail, the schedule
before the tail unchanged, and the extension is the run's from then on."""

from __future__ import annotations

import json
import math

import pytest

from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.training.optim import lr_factor
from tests.helpers import run_cli

ARGS = ["--steps", 3, "--batch-size", 1, "--seq-len", 16, "--eval-batches", 1, "--log-every", 1, "--warmup", 1]


def test_a_tail_leaves_the_schedule_before_it_and_rises_from_where_it_ended():
    plain = dict(warmup=10, min_ratio=0.1)
    before = [lr_factor(s, steps=100, **plain) for s in range(100)]
    extended = [lr_factor(s, steps=150, tails=(100,), **plain) for s in range(160)]
    assert extended[:100] == before and before[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 89 / 90)))
    # The tail: a warm-up of min(10, 50 // 5) steps from 0.1 back to 1, then a cosine to 0.1 at step 150.
    assert extended[100] == pytest.approx(0.1 + 0.9 / 10) and extended[109] == pytest.approx(1.0)
    assert extended[110] == 1.0 and all(a > b for a, b in zip(extended[110:150], extended[111:150], strict=False))
    assert extended[150:] == [pytest.approx(0.1)] * 10
    short = [lr_factor(s, steps=103, tails=(100,), **plain) for s in range(100, 103)]
    assert short[0] == pytest.approx(1.0) and short[-1] < 1  # a tail shorter than 5 steps: no warm-up


def test_a_finished_run_is_extended(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("".join(f"z{i} = '{i:x}'\n" for i in range(800)))
    run = tmp_path / "run"
    assert run_cli(["train", "--out", run, "--data", data, *ARGS], capsys)[0] == 0
    code, _, err = run_cli(["train", "--resume", "--out", run, "--steps", 5], capsys)
    assert code == 1 and "--steps 5 (the run has 3)" in err and "--extend-steps N trains it N steps further" in err
    code, out, err = run_cli(["train", "--resume", "--out", run, "--extend-steps", 2], capsys)
    assert code == 0 and "done: step 5/5" in out and "resuming at step 3" in out, err
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["steps"], saved["extended_at"]) == (5, [3]) and ckpt.checkpoint_step(run) == 5
    rows = ckpt.read_log(run)
    schedule = dict(warmup=1, steps=5, min_ratio=0.1, tails=(3,))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows] == pytest.approx([3e-3 * lr_factor(s, **schedule) for s in range(5)])
    code, out, _ = run_cli(["train", "--resume", "--out", run], capsys)
    assert code == 0 and "the run is complete (step 5 of 5)" in out
    code, _, err = run_cli(["train", "--out", tmp_path / "new", "--extend-steps", 2], capsys)
    assert code == 1 and "--extend-steps trains a run further: pass --resume" in err
