"""benchmarks/bench_train.py --quick runs on the CPU: a table, a JSON last line, failures listed and not fatal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, checkout_env

ROOT = REPO_ROOT


def test_quick_run_lists_results_and_failures():
    cmd = [sys.executable, "benchmarks/bench_train.py", "--quick", "--cases", "ours-standard,fla-kda"]
    cmd += ["--shapes", "1x16", "--steps", "1", "--warmup", "0", "--profile", "--modes", "eager,graph"]
    env = checkout_env()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("| ours-standard |") for line in lines), out.stdout
    results = json.loads(lines[-1])["results"]
    rows = {r["case"]: r for r in results if r["mode"] == "eager"}
    ok = rows["ours-standard"]
    assert ok["error"] is None and ok["tokens_per_s"] > 0 and ok["flops_per_token"] > 0, ok
    assert 0 < ok["host_ms"] <= ok["step_ms"] and ok["kernel_ms"] is None, ok  # no kernel time off CUDA
    assert ok["tables_per_step"] == 0, ok  # no AttnRes kernels in a standard residual
    # FLA's kernels need CUDA (and FLA may be absent): on the CPU this case fails, and is listed as failed.
    assert rows["fla-kda"]["error"], rows["fla-kda"]
    # A CUDA graph needs CUDA: on the CPU the graph mode of a case that runs eagerly is listed as failed, with why.
    graphed = next(r for r in results if r["mode"] == "graph" and r["case"] == "ours-standard")
    assert "cuda_graph=True needs parameters on a CUDA device, got cpu" in graphed["error"], graphed


def test_quick_run_with_muon():
    """`--optimizer muon` trains with train's Muon + AdamW; its graph mode is refused on the CPU for the device alone
    (the optimizer can be captured)."""
    cmd = [sys.executable, "benchmarks/bench_train.py", "--quick", "--cases", "ours-full", "--optimizer", "muon"]
    cmd += ["--shapes", "1x16", "--steps", "1", "--warmup", "1", "--modes", "eager,graph"]
    env = checkout_env()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["optimizer"] == "Muon (hidden matrices) + AdamW", result["optimizer"]
    eager, graphed = result["results"]
    assert eager["error"] is None and eager["tokens_per_s"] > 0, eager
    assert graphed["error"].endswith("cuda_graph=True needs parameters on a CUDA device, got cpu"), graphed


def test_grad_accum_times_every_micro_batch_of_a_step():
    """--grad-accum N: each timed step runs N micro-batches and one optimizer step, and tokens/s counts all of them."""
    cmd = [sys.executable, "benchmarks/bench_train.py", "--quick", "--cases", "ours-standard", "--grad-accum", "3"]
    cmd += ["--shapes", "2x16", "--steps", "1", "--warmup", "0"]
    out = subprocess.run(cmd, cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 micro-batches per optimizer step" in out.stdout and "| 3 x 2 x 16 |" in out.stdout, out.stdout
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert row["error"] is None and row["grad_accum"] == 3, row
    assert row["tokens_per_s"] == 3 * 2 * 16 / (row["step_ms"] / 1e3), row


def test_grad_accum_below_one_is_refused(capsys):
    from benchmarks.bench_train import main

    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--grad-accum", "0"])
    assert exit_.value.code == 2 and "--grad-accum: expected a value >= 1, got 0" in capsys.readouterr().err
