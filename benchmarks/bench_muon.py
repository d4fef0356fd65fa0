"""The Muon step alone, at a preset's hidden matrices: torch.optim.Muon against muon.StackedMuon.

Per optimizer: the operators one step issues (counted on the meta device with a TorchDispatchMode, views left out:
what a step launches, give or take the few kernels a foreach operator may split into), and on CUDA the step's time,
the `triton.testing.do_bench` median, eagerly and (StackedMuon, whose learning rate may be a device tensor) replayed
from a CUDA graph. Gradients are random, the learning rate and options those of `train --optimizer muon`.

    python benchmarks/bench_muon.py --count-only             # the operator counts, on any machine
    python benchmarks/bench_muon.py                          # counts and times (CUDA)

Markdown table on stdout, JSON as the last line (also written to --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_common import emit_json, env_info, log  # noqa: E402
from hybrid_attention.config import (
    PRESETS,  # noqa: E402
    HybridConfig,  # noqa: E402
)
from hybrid_attention.model import HybridLM
from hybrid_attention.training.muon import StackedMuon  # noqa: E402
from hybrid_attention.training.optim import param_groups  # noqa: E402

OPTIONS = dict(lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")  # as optim.build_optimizers


class _Operators(TorchDispatchMode):
    """Counts the operators that compute something: a view launches nothing, nor does `_unsafe_view` (a view that
    its schema does not declare as one)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view and func.__name__ != "_unsafe_view.default":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _matrices(preset: str, device: str) -> list[torch.nn.Parameter]:
    """Fresh copies of the preset's Muon matrices, each with a random gradient."""
    with torch.device("meta"):
        shapes = [p.shape for p in param_groups(HybridLM(HybridConfig.from_preset(preset)), 0.1, muon=True)[1]]
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def count_operators(cls, preset: str) -> tuple[int, int]:
    """(matrices, operators of one step after the first, which makes the momentum buffers) on the meta device."""
    params = _matrices(preset, "meta")
    opt = cls(params, **OPTIONS)
    opt.step()
    with _Operators() as ops:
        opt.step()
    return len(params), ops.count


def time_step(cls, preset: str, graph: bool) -> float:
    """Median ms of one step on CUDA, eager or replayed from a CUDA graph (learning rate as a device tensor)."""
    from triton.testing import do_bench

    opt = cls(_matrices(preset, "cuda"), **OPTIONS)
    if not graph:
        return do_bench(opt.step, warmup=25, rep=200)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the momentum buffers and cuBLAS handles, outside the capture
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        opt.step()
    return do_bench(captured.replay, warmup=25, rep=200)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3-scaled", choices=sorted(PRESETS))
    p.add_argument("--count-only", action="store_true", help="only count the operators (no GPU needed)")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    timed = not args.count_only
    if timed and not torch.cuda.is_available():
        p.error("timing needs a CUDA device (or --count-only)")

    rows = []
    for name, cls in (("torch.optim.Muon", torch.optim.Muon), ("StackedMuon", StackedMuon)):
        log(f"{name} ...")
        matrices, operators = count_operators(cls, args.preset)
        row = dict(optimizer=name, matrices=matrices, operators=operators)
        if timed:
            row["eager_ms"] = time_step(cls, args.preset, graph=False)
            row["graph_ms"] = time_step(cls, args.preset, graph=True) if cls is StackedMuon else None
        rows.append(row)

    print(f"## Muon step, {args.preset}'s hidden matrices\n")
    print("| optimizer | matrices | operators per step | eager ms | graph ms |\n|---|---|---|---|---|")
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        print(f"| {r['optimizer']} | {r['matrices']} | {r['operators']} | {fmt(r.get('eager_ms'))} | "
              f"{fmt(r.get('graph_ms'))} |")  # fmt: skip
    env = env_info(sys.argv) if timed else dict(device="cpu", torch=torch.__version__)
    result = dict(env=env, preset=args.preset, options=OPTIONS, results=rows)
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
