"""benchmarks/profile_serve.py runs on the CPU with the tiny preset: each prompt is prefilled whole, alone in the
engine's idle chunks and beside decoding sequences in chunks within the per-iteration budget, then profiled."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO_ROOT, checkout_env


def test_tiny_run_on_the_cpu(tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "profile_serve.py"), "--preset", "tiny", "--device", "cpu"]
    cmd += ["--prompts", "200,333", "--max-batched-tokens", "150", "--decoding", "3", "--top", "5"]
    env = checkout_env()
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    idle = result["idle_prefill_tokens"]
    for length in (200, 333):
        for run in result["alone"][str(length)]:
            assert sum(run["chunk_tokens"]) == length and max(run["chunk_tokens"]) <= idle, run
            assert run["ttft_s"] > 0 and len(run["iteration_ms"]) == run["prefill_iterations"]
        joining = result["joining"][str(length)]
        assert sum(joining["chunk_tokens"]) == length, joining
        assert max(joining["chunk_tokens"]) <= 150 - 3 < length and joining["prefill_iterations"] >= 2, joining
    assert result["decode_only_ms"] > 0
    assert "host functions of the next iteration" in out.stdout
