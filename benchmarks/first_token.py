"""Benchmark: time to the first generated token in a new process, the way `hybrid-attention generate` starts.

Each run is a fresh Python process (a subprocess of this script) that builds a random model of --preset on CUDA
(initialised there, as `load_run` does before it loads a checkpoint), in bf16, and calls `generate_stream`. As the
CLI does, it first calls `ops.warm_start.warm_start` (kernel imports, and a thread for Triton's cache key and the
first cuBLAS, attention and sampling calls) so that those overlap the model's construction; `--no-warm-start` leaves
it out, for comparison. Reported per run: the time from the process's start to the model being ready, and from the
model being ready to the first token (prefill and sampling, with the first call of every kernel they use), to the
second token (which includes building and capturing the decode step) and to the last. The first run on a machine
compiles and tunes the Triton kernels; the runs after it find them in Triton's on-disk cache, as a user's second
`generate` does. With --profile the last run also prints a cProfile of its first token, to show where the first
calls of the kernels spend their time.

    python benchmarks/first_token.py [--preset k3-scaled] [--runs 3] [--no-warm-start] [--profile] [--out F]

Prints a table, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench_common import emit_json, env_info, log

CHILD = r"""
import cProfile, io, json, pstats, sys, time
spawned = float(sys.argv[5])
import torch
from hybrid_attention.inference.generate import generate_stream
from hybrid_attention.model import HybridConfig, HybridLM
from hybrid_attention.ops.warm_start import warm_start

preset, new_tokens, profile, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
if warm:
    warm_start("cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
with torch.device("cuda"):  # as `load_run` builds a model whose weights it then loads
    model = HybridLM(HybridConfig.from_preset(preset)).to(torch.bfloat16).eval()
ids = torch.tensor([[5, 9]], device="cuda")
torch.cuda.synchronize()
ready_s = time.time() - spawned
profiler = cProfile.Profile() if profile else None
start = time.perf_counter()
if profiler:
    profiler.enable()
times = []
for token in generate_stream(model, ids, new_tokens, 1.0):
    token.item()  # the token is on the host: what a user sees
    times.append(time.perf_counter() - start)
    if profiler and len(times) == 1:
        profiler.disable()
if profiler:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    print(text.getvalue(), file=sys.stderr)
record = {"ready_s": ready_s, "first_s": times[0], "second_s": times[1], "last_s": times[-1]}
print(json.dumps({**record, "tokens": len(times)}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="k3-scaled")
    parser.add_argument("--runs", type=int, default=3, help="processes in a row; the first one may compile")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-warm-start", action="store_true", help="leave out warm_start, as a library caller might")
    parser.add_argument("--profile", action="store_true", help="cProfile the last run's first token (stderr)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 2:
        parser.error("--runs must be >= 1 and --new-tokens >= 2")
    rows = []
    for run in range(args.runs):
        profile = args.profile and run == args.runs - 1
        flags = ["1" if profile else "0", "0" if args.no_warm_start else "1", repr(time.time())]
        argv_child = [sys.executable, "-c", CHILD, args.preset, str(args.new_tokens), *flags]
        done = subprocess.run(argv_child, capture_output=True, text=True, timeout=900)
        if profile or done.returncode != 0:
            sys.stderr.write(done.stderr)
        if done.returncode != 0:
            rows.append({"run": run + 1, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({"run": run + 1, **json.loads(done.stdout.strip().splitlines()[-1])})
        log(f"run {run + 1}: first token {rows[-1]['first_s']:.3f} s")
    warm = "without warm_start" if args.no_warm_start else "with warm_start"
    print(f"\n## first token, {args.preset}, bf16, 2-token prompt, a new process per run, {warm}\n")
    print("| run | process start to model ready s | first token s | second token s | last token s |")
    print("|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['run']} | failed: {row['error']} | | | |")
        else:
            times = (row[k] for k in ("ready_s", "first_s", "second_s", "last_s"))
            print(f"| {row['run']} | " + " | ".join(f"{t:.3f}" for t in times) + " |")
    emit_json({"env": env_info(sys.argv), "preset": args.preset, "warm_start": not args.no_warm_start, "runs": rows},
              args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
