"""The command line on CUDA: bf16 autocast training, torch.compile, resume, generate and eval (skips without CUDA).

Run on a GPU machine: python -m pytest -q tests/gpu/training/test_loop_gpu.py
"""

from __future__ import annotations

import json
import math
import re

from hybrid_attention import cli
from hybrid_attention.runs.checkpoint import read_log
from tests.helpers import needs_cuda

pytestmark = needs_cuda

FAST = ["--steps", "6", "--batch-size", "4", "--seq-len", "64", "--data-max-bytes", "200000", "--eval-batches", "2",
        "--log-every", "1", "--eval-every", "3", "--device", "cuda"]  # fmt: skip


def run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def test_train_bf16_then_generate_and_eval(tmp_path, capsys):
    run = tmp_path / "run"
    out, _ = run_cli(["train", "--out", run, *FAST], capsys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["peak_memory_bytes"] > 0 and math.isfinite(summary["val_loss"]) and summary["tokens_per_s"] > 0
    assert "peak memory" in out and "model FLOPs utilisation" in out
    out, err = run_cli(
        ["generate", "--ckpt", run, "--prompt", "def ", "--max-new-tokens", 16, "--device", "cuda"], capsys
    )
    assert out.startswith("def ") and re.search(r"16 tokens in .* tokens/s; cache [\d,]+ bytes", err)
    out, _ = run_cli(["eval", "--ckpt", run, "--device", "cuda"], capsys)
    assert re.search(r"loss [\d.]+ nats/token, [\d.]+ bits/byte", out)


def test_resume_on_cuda_float32_matches(tmp_path, capsys):
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(["train", "--out", full, *FAST, "--dtype", "float32"], capsys)
    run_cli(["train", "--out", split, *FAST, "--dtype", "float32", "--stop-after", "3"], capsys)
    run_cli(["train", "--out", split, "--resume"], capsys)
    a = {r["step"]: r["loss"] for r in read_log(full)}
    b = {r["step"]: r["loss"] for r in read_log(split)}
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:  # GPU kernels may reorder sums (atomics), so equal to float32 noise, not bitwise
        assert abs(a[step] - b[step]) <= 1e-4 * abs(a[step]), (step, a[step], b[step])


def test_compiled_training(tmp_path, capsys):
    run = tmp_path / "compiled"
    run_cli(["train", "--out", run, *FAST, "--compile"], capsys)
    rows = read_log(run)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
