"""Where a CUDA-graph decode step (or a prefill) of k3-scaled spends its time: every kernel, grouped by name.

    python benchmarks/profile_decode.py [--model hybrid|all-mla] [--batch 1] [--context 4096] [--no-pack]
                                        [--gemv auto|torch] [--out f]
    python benchmarks/profile_decode.py --prefill [--model ...] [--context 4096] [--host 30]

Replays the captured step (as bench_decode.py builds it) under torch.profiler and reads the kernels of the last
replay from the trace (with --prefill: of one eager prefill of --context tokens into an empty cache): count, summed
kernel time and the idle gaps between consecutive kernels. Kernel time near the step time means the kernels
themselves are slow; large gaps mean the step is bound by launch latency. Prints a table per kernel name, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch
from bench_common import emit_json, env_info, log
from bench_decode import MODELS, build_model, fill_cache, median_event_ms


def profiled_kernels(fn, replays: int = 3) -> list[dict]:
    """Kernels of the last of `replays` calls of fn (a graph replay, a prefill): dicts with name, ts and dur
    (microseconds), in launch order. The profiler's schedule records only that call (the earlier ones warm CUPTI
    up); splitting one trace of every call at its largest idle gaps mixed several calls when a call's own gaps
    were larger than those between calls (a host-bound prefill)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        only_last = schedule(wait=0, warmup=replays - 1, active=1)
        export = lambda prof: prof.export_chrome_trace(path)  # noqa: E731 (the events are cleared after the cycle)
        with profile(activities=[ProfilerActivity.CUDA], schedule=only_last, on_trace_ready=export) as prof:
            for _ in range(replays):
                fn()
                torch.cuda.synchronize()
                prof.step()
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        raise RuntimeError("profile_decode: the profiler recorded no kernels in the profiled call")
    return [dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"])) for e in kernels]


def summarise(kernels: list[dict]) -> dict:
    by_name: dict[str, dict] = defaultdict(lambda: dict(count=0, us=0.0))
    for k in kernels:
        by_name[k["name"]]["count"] += 1
        by_name[k["name"]]["us"] += k["dur"]
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = sum(k["dur"] for k in kernels)
    return dict(kernels=len(kernels), span_us=span, kernel_us=busy, gap_us=span - busy, by_name=dict(by_name))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="hybrid")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument("--no-pack", action="store_true", help="decode without packed projections (layers/packed.py)")
    p.add_argument("--gemv", choices=("auto", "torch"), default="auto",
                   help="the packed step's products: decode GEMV kernel (auto) or cuBLAS (torch)")  # fmt: skip
    p.add_argument("--prefill", action="store_true", help="profile one eager prefill of --context tokens instead")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="also print the N Python functions with the most host time in one call (cProfile)")  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    from hybrid_attention.inference.decode_graph import DecodeStep
    from hybrid_attention.inference.prefill import prefill

    model = build_model(MODELS[args.model], "auto")
    cache = model.make_cache(args.batch, args.context + 64)
    if args.prefill:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context), device="cuda")

        def call():
            cache.reset()  # a few zeroing kernels of the KDA states (~0.5 MB per layer at B=1), timed with it
            prefill(model, ids, cache)

        what = "prefill"
    else:
        step = DecodeStep(model, cache, cuda_graph=True, pack_projections=not args.no_pack, gemv=args.gemv)
        fill_cache(cache, args.context)
        call, what = step.replay, "replay"
    for _ in range(3):  # warm-up: compilation, autotuning
        call()
    step_ms, _ = median_event_ms(call, 5 if args.prefill else 20)
    log(f"{args.model} B={args.batch} context={args.context}: {step_ms:.3f} ms per {what}")
    result = dict(env=env_info(["benchmarks/profile_decode.py", *argv]), model=args.model, batch=args.batch)
    result.update(packed_projections=not args.no_pack and not args.prefill, gemv=args.gemv, mode=what)
    result.update(context=args.context, step_ms=step_ms, **summarise(profiled_kernels(call)))
    print(f"\n{result['kernels']} kernels, span {result['span_us']:.1f} us, kernel time {result['kernel_us']:.1f} us, "
          f"gaps {result['gap_us']:.1f} us ({what} {step_ms * 1e3:.1f} us)")  # fmt: skip
    print(f"{'count':>5} {'total us':>9} {'us each':>8}  kernel")
    for name, s in sorted(result["by_name"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"{s['count']:>5} {s['us']:>9.1f} {s['us'] / s['count']:>8.2f}  {name[:110]}")
    if args.host:
        print_host_profile(call, args.host)
    emit_json(result, args.out)
    return 0


def print_host_profile(call, top: int) -> None:
    """Where the host spends one call, by Python function (own time and cumulative): with idle gaps between the
    kernels (a host-bound prefill) this names what keeps the GPU waiting: launch overheads, a host sync (time in
    `item`, `tolist`, `synchronize`), Python work per layer."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    torch.cuda.synchronize()
    profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
        print(f"\nhost time of one call, by {key}:\n{text.getvalue()}")


if __name__ == "__main__":
    sys.exit(main())
