"""benchmarks/bench_prefill.py runs on the CPU with the tiny preset: tables, a JSON last line, the MLA attention
against SDPA's CPU flash kernel (cuDNN recorded as failed there), chunk_kda in one call and in chunks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, checkout_env


def test_tiny_run_on_the_cpu(tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_prefill.py"), "--preset", "tiny", "--lengths", "40"]
    cmd += ["--batched", "2x24", "--models", "hybrid,llama-sdpa", "--new-tokens", "3", "--profile", "32"]
    cmd += ["--plot", str(tmp_path / "p.png")]
    env = checkout_env()
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failures"] == [], result["failures"]
    rows = {(r["model"], r["B"], r["N"]): r for r in result["prefill"]}
    assert set(rows) == {("hybrid", 1, 40), ("hybrid", 2, 24), ("llama-sdpa", 1, 40)}
    assert all(r["s"] > 0 and r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows[("hybrid", 1, 40)]["decode_ms"] > 0
    attention = {(r["B"], r["N"]): r for r in result["attention"]}
    assert attention[(1, 40)]["mla_auto_tflops"] > 0 and attention[(1, 40)]["sdpa_flash_tflops"] > 0
    assert "sdpa_cudnn_error" in attention[(2, 24)]
    (kda,) = result["kda"]
    assert kda["N"] == 40 and kda["state_rel_diff"] < 1e-12
    assert result["plot"] == str(tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
    assert result["profile"]["N"] == 32 and "error" not in result["profile"], result["profile"]
    assert "MLA prefill attention" in out.stdout and set(result["thresholds"].values()) == {None}


def test_bad_lengths_are_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))  # the script imports its sibling modules by name
    from benchmarks.bench_prefill import main

    bad = (["--lengths", "none"], ["--lengths", "8Q"], ["--lengths", "0"], ["--batched", "32"], ["--batched", "0x8K"])
    for flags in bad:
        with pytest.raises(SystemExit) as exit_:
            main(["--preset", "tiny", *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: {flags[0]} " in err, (flags, err)
