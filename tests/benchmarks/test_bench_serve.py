"""benchmarks/bench_serve.py under --quick on the CPU: a real server process driven over HTTP, with the output
lengths of every scenario set from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, checkout_env

pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")
SCRIPT = str(REPO_ROOT / "benchmarks" / "bench_serve.py")


def run(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = checkout_env()
    cmd = [sys.executable, SCRIPT, "--quick", "--no-overhead", "--systems", "hybrid", "--plot", str(tmp_path / "p.png")]
    return subprocess.run([*cmd, *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_output_tokens_set_every_completion_length(tmp_path):
    out = run(tmp_path, "--output-tokens", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["scenarios"] == {"quick": ["32:64", "5"]}
    assert result["plot"] == str(tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0, result["plot"]
    trials = result["results"]["quick"]["hybrid"]["trials"]
    held = [t for t in trials if t["held"]]
    assert held, trials
    for t in held:  # every request of a held trial completed with exactly 5 tokens
        assert t["completed"] == t["requests"]
        assert t["output_tokens_per_s"] == pytest.approx(5 * t["requests_per_s"], rel=1e-9)


def test_bad_output_tokens_are_named(tmp_path):
    out = run(tmp_path, "--output-tokens", "9:3")
    assert out.returncode == 2 and "--output-tokens" in out.stderr and "LOW <= HIGH" in out.stderr, out.stderr
