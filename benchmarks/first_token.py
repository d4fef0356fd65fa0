"""Benchmark: time to the first generated token in a new process, the way `hybrid-attention generate` starts.

Each run is a fresh Python process (a subprocess of this script) that builds a random model of --preset in bf16 on
CUDA and calls `generate_stream`; it reports the time from the model being ready to the first token (prefill and
sampling, with the first call of every kernel they use), to the second token (which includes building and capturing
the decode step) and to the last. The first run on a machine compiles and tunes the Triton kernels; the runs after
it find them in Triton's on-disk cache, as a user's second `generate` does. With --profile the last run also prints
a cProfile of its first token, to show where the first calls of the kernels spend their time.

    python benchmarks/first_token.py [--preset k3-scaled] [--runs 3] [--profile] [--out results.json]

Prints a table, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench_common import emit_json, env_info, log

CHILD = r"""
import cProfile, io, json, pstats, sys, time
import torch
from hybrid_attention.generate import generate_stream
from hybrid_attention.model import HybridConfig, HybridLM

preset, new_tokens, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
torch.manual_seed(0)
model = HybridLM(HybridConfig.from_preset(preset)).to("cuda", torch.bfloat16).eval()
ids = torch.tensor([[5, 9]], device="cuda")
torch.cuda.synchronize()
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
print(json.dumps({"first_s": times[0], "second_s": times[1], "last_s": times[-1], "tokens": len(times)}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="k3-scaled")
    parser.add_argument("--runs", type=int, default=3, help="processes in a row; the first one may compile")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="cProfile the last run's first token (stderr)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 2:
        parser.error("--runs must be >= 1 and --new-tokens >= 2")
    rows = []
    for run in range(args.runs):
        profile = args.profile and run == args.runs - 1
        argv_child = [sys.executable, "-c", CHILD, args.preset, str(args.new_tokens), "1" if profile else "0"]
        done = subprocess.run(argv_child, capture_output=True, text=True, timeout=900)
        if profile or done.returncode != 0:
            sys.stderr.write(done.stderr)
        if done.returncode != 0:
            rows.append({"run": run + 1, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({"run": run + 1, **json.loads(done.stdout.strip().splitlines()[-1])})
        log(f"run {run + 1}: first token {rows[-1]['first_s']:.3f} s")
    print(f"\n## first token, {args.preset}, bf16, 2-token prompt, a new process per run\n")
    print("| run | first token s | second token s | last token s |\n|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['run']} | failed: {row['error']} | | |")
        else:
            print(f"| {row['run']} | {row['first_s']:.3f} | {row['second_s']:.3f} | {row['last_s']:.3f} |")
    emit_json({"env": env_info(sys.argv), "preset": args.preset, "runs": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
