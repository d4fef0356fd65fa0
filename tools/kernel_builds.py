"""Times of the Triton KDA kernels in several builds of this repository, on one GPU: which change moved which kernel.

    python tools/kernel_builds.py REV [REV ...] [--shape 8,4096,16,128] [--backward] [--kernels prep,dqkg]
    python tools/kernel_builds.py REV [REV ...] --list       # the autotuned kernels and configs of each build

Each REV is a git revision, or `.` for the working tree as it is (uncommitted edits included). Every build is copied
to a temporary folder (`git archive`), warmed up in its own process, all builds at once (compiling is most of the
work, and Triton's cache keeps the binaries), then timed one build at a time: bench_kda.py's chunk op and inputs,
from this checkout, on each build's package (bf16, the bounded gate at -5 and the q/k L2 norm in the kernels), the
forward or with --backward the forward and backward, once per autotune config of each named kernel with that config
forced. The table gives each named kernel's CUDA time per call (torch.profiler), and that of all the op's kernels.
Static counts (tools/kernel_stats.py) do not predict what a change does to a register-bound kernel: time the builds
side by side, and bisect with variants of a kernel committed or left in the working tree.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export_build(rev: str, into: Path) -> Path:
    """The package of revision `rev` (or of the working tree for ".") under `into`; returns the build's root."""
    root = into / ("worktree" if rev == "." else rev.replace("/", "_").replace("~", "-").replace("^", "-"))
    root.mkdir(parents=True)
    if rev != "." and subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                                     capture_output=True).returncode != 0:  # fmt: skip
        raise SystemExit(f'kernel_builds: {rev!r} is not a revision of {REPO}; give git revisions, or "." for the '
                         "working tree")  # fmt: skip
    if rev == ".":
        shutil.copytree(REPO / "hybrid_attention", root / "hybrid_attention",
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "hybrid_attention"], check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "x", "-C", str(root)], input=archive, check=True)
    return root


def autotuned_kernels() -> dict:
    """{name: autotuner} of every autotuned KDA kernel of the imported build (`_prep_kernel` -> "prep"), wherever
    that build keeps its kernel modules."""
    import triton

    import hybrid_attention.ops.kda as kda

    tuners = {}
    for info in pkgutil.walk_packages(kda.__path__, kda.__name__ + "."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, triton.runtime.Autotuner):
                name = value.base_fn.__name__
                tuners[name.removeprefix("_").removesuffix("_kernel")] = value
    return tuners


def all_configs(tuner) -> list:
    """Every config of an autotuned kernel: builds that keep the full list beside the tuned one (`all_configs`, as
    under the Triton interpreter, which tunes the first only) and builds that do not."""
    return list(getattr(tuner, "all_configs", tuner.configs))


def config_label(config) -> str:
    """An autotune config in a few words: its meta-parameters, warps and pipeline stages."""
    return " ".join([f"{k}={v}" for k, v in config.kwargs.items()] + [f"warps={config.num_warps}",
                                                                       f"stages={config.num_stages}"])  # fmt: skip


def worker(args) -> None:
    """In a build's own process: one JSON line per (kernel, config), or with --list the kernels and configs."""
    tuners = autotuned_kernels()
    if args.list:
        print(json.dumps({name: [config_label(c) for c in all_configs(t)] for name, t in sorted(tuners.items())}))
        return
    import torch

    # This checkout's benchmark code, on the build's package (first on sys.path): bench_kda.py's inputs and op call.
    sys.path.insert(1, str(REPO / "benchmarks"))
    from bench_kda import op_inputs, ours_op
    from profile_kda import kernel_times

    B, T, H, D = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    inputs = [x.requires_grad_(args.backward) for x in op_inputs(B, T, H, D)]
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.set_grad_enabled(args.backward):
            o = ours_op(*inputs)
            if args.backward:
                for x in inputs:
                    x.grad = None
                o.backward(do)

    for name in args.kernels.split(","):
        if name not in tuners:
            error = f"no autotuned kernel {name!r}; this build has {sorted(tuners)}"
            print(json.dumps({"kernel": name, "error": error}))
            continue
        tuner, configs = tuners[name], list(tuners[name].configs)
        for config in all_configs(tuner):
            tuner.configs = [config]
            times = kernel_times(step, 1 if args.warm else args.iters)
            ms = times.get(tuner.base_fn.__name__, float("nan"))
            row = {"kernel": name, "config": config_label(config), "ms": ms, "op_ms": sum(times.values())}
            print(json.dumps(row), flush=True)
        tuner.configs = configs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("revs", nargs="+", help='git revisions, or "." for the working tree')
    p.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D (K = V = D)")
    p.add_argument("--kernels", default="prep", help="comma-separated kernel names (see --list)")
    p.add_argument("--backward", action="store_true", help="time forward + backward (needed for backward kernels)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--list", action="store_true", help="list each build's autotuned kernels and configs, run nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a build's root: run inside that build
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        sys.path.insert(0, args.worker)
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        builds = {rev: export_build(rev, Path(tmp)) for rev in args.revs}
        options = ["--shape", args.shape, "--kernels", args.kernels, "--iters", str(args.iters)]
        options += ["--backward"] * args.backward + ["--list"] * args.list

        def start(root: Path, *extra: str) -> subprocess.Popen:
            env = dict(os.environ, PYTHONPATH=str(root))
            return subprocess.Popen([sys.executable, __file__, *options, *extra, "--worker", str(root), "."], env=env,
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip

        if not args.list:  # compile every build at once; the timed runs below then find their binaries cached
            for proc in [start(root, "--warm") for root in builds.values()]:
                proc.communicate()
        rows = {}
        for rev, root in builds.items():
            out = start(root).communicate()[0]
            rows[rev] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if not args.list:
                print(f"{rev}: timed", file=sys.stderr, flush=True)
    if args.list:
        for rev, lines in rows.items():
            for name, configs in (lines[0] if lines else {}).items():
                print(f"{rev:>12}  {name:<12} {' | '.join(configs)}")
        return
    mode = "forward + backward" if args.backward else "forward"
    print(f"CUDA ms per call at {args.shape}, {mode}: the named kernel, then all the op's kernels together")
    for rev, lines in rows.items():
        if not lines:
            print(f"{rev:>12}  no result: its worker failed (its error is above)")
        for r in lines:
            if "error" in r:
                print(f"{rev:>12}  {r['kernel']:<10} {r['error']}")
            else:
                print(f"{rev:>12}  {r['kernel']:<10} {r['config']:<28} {r['ms']:8.3f} {r['op_ms']:8.3f}")


if __name__ == "__main__":
    main()
