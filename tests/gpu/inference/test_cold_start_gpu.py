"""Cold and warm starts of `hybrid-attention generate` on CUDA, each in a new process with its own Triton cache folder:
the cold one says that it compiles and leaves compiled kernels and autotuning choices on disk; the warm one
compiles nothing, says nothing about it, and reaches its first token in under a second.

Run on a GPU machine: python -m pytest -q tests/gpu/inference/test_cold_start_gpu.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_attention import cli
from tests.helpers import REPO_ROOT, checkout_env

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.tuned]

ROOT = REPO_ROOT


def _generate(run: Path, triton_cache: Path) -> tuple[str, float]:
    env = checkout_env(TRITON_CACHE_DIR=str(triton_cache))
    env.pop("TRITON_INTERPRET", None)
    argv = [sys.executable, "-m", "hybrid_attention", "generate", "--ckpt", str(run), "--prompt", "import os",
            "--max-new-tokens", "16", "--device", "cuda"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
    first = re.search(r"first token ([\d.]+) s", done.stderr)
    assert first, done.stderr
    return done.stderr, float(first.group(1))


def test_generate_warm_start_compiles_nothing_and_is_fast(tmp_path):
    run = tmp_path / "run"
    flags = ["--steps", "2", "--batch-size", "2", "--seq-len", "64", "--data-max-bytes", "200000", "--device", "cuda"]
    assert cli.main(["train", "--out", str(run), *flags]) == 0
    cache = tmp_path / "triton"
    cold, cold_s = _generate(run, cache)
    assert "compiling Triton kernel" in cold
    assert list(cache.rglob("*.autotune.json")), "no autotuning choices were kept on disk"
    warm, warm_s = _generate(run, cache)
    assert "compiling Triton kernel" not in warm, warm
    assert warm_s < 1.0, (cold_s, warm_s)
    print(f"first token: cold {cold_s:.2f} s, warm {warm_s:.3f} s")
