"""benchmarks/bench_attnres_configs.py launches each kernel's JIT function with its own argument list, bypassing the
autotuner: every launch of both sweeps runs under the interpreter at a tiny size, so a kernel whose arguments change
without the benchmark's fails here instead of timing nothing on the GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attnres_configs as bench  # noqa: E402

from tests.helpers import needs_triton  # noqa: E402


@needs_triton
def test_every_launch_runs(monkeypatch):
    M, D, K = 3, 16, 4
    for name, value in (("M", M), ("D", D), ("K", K)):
        monkeypatch.setattr(bench, name, value)
    launches = []

    def run_once(fn, graph=False) -> float:  # the launch itself, not its time: an error propagates
        fn()
        launches.append(fn)
        return 1.0

    monkeypatch.setattr(bench, "_time_us", run_once)
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(M, D, generator=gen) for _ in range(K)]
    queries, key_ws = torch.randn(K, D, generator=gen), torch.rand(K, D, generator=gen) + 0.5
    norm_w = torch.rand(D, generator=gen) + 0.5
    forward = bench.forward_sweep(sources, queries, key_ws, norm_w, [K], [16])
    backward = bench.backward_sweep(sources, queries, key_ws, norm_w, [1, K - 1], [8])
    assert forward and backward and len(launches) == len(forward) + len(backward)
    assert all(t == 1.0 for t in [*forward.values(), *backward.values()])
