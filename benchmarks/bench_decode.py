"""Benchmark: long-context decoding of the k3-scaled hybrid (KDA:MLA 3:1) against its all-MLA baseline, bf16.

For each model, batch (1, 32) and context (4K .. 512K) the whole-model decode step (embedding -> logits, with the
cache appends) is captured once in a CUDA graph and replayed; the cache is filled with random rows and states and its
lengths set to the context instead of prefilling it (a prefill of 32 x 512K tokens would take far longer than the
whole budget). Reported per case: median time per output token (CUDA events around single replays), tokens per
second (B / time), cache bytes per sequence at that context, and the bytes a step must read (weights, latent rows,
KDA states read and written) over the time. Also: eager (no graph) time and GPU kernels per step at batch 1, the MLA
decode kernel alone at batch x context >= 1M (TB/s), and prefill time per context at batch 1 (chunked prefill, timed
on a second call up to 128K so that first-call tuning stays out, skipped when the quadratic extrapolation of the
previous context exceeds the time left). Cases that do not fit in memory are skipped with a note; all-MLA at
32 x 512K needs 126 GB of cache and is always skipped.

    python benchmarks/bench_decode.py [--quick] [--out results.json] [--plot decode_latency.png]

Prints tables, then one JSON line (also written to --out); the plot goes to benchmarks/decode_latency.png unless --plot
names another file, from whatever directory it runs. Every case runs in try/except: failures are reported and
the run continues. The thresholds of `check_thresholds` are checked at the end; figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import emit_json, env_info, log

CONTEXTS = [4096, 16384, 65536, 131072, 524288]
BATCHES = [1, 32]
MODELS = {"hybrid": "k3-scaled", "all-mla": "k3-scaled-all-mla"}
REPEAT_PREFILL_UP_TO = 131072  # prefills up to this context are timed on a second call (512K all-MLA takes a minute)
COPY_CEILING_GBS = 4270.0  # an H200's device-to-device copy rate, bytes read + written (docs/performance.md)


def build_model(preset: str, kda_backend: str):
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset(preset), kda_backend=kda_backend).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # non-trivial AttnRes mixing (the cost does not depend on it, the numerics do)
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0.0, 0.5)
    return model


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def fill_cache(cache, context: int) -> None:
    """Random latent rows (unit scale, like RMS-normalised c) and small random KDA states, lengths = context."""
    from hybrid_attention.layers.mla import MLACache

    for layer in cache.layers:
        if isinstance(layer, MLACache):
            layer.rows.normal_()
        else:
            layer.state.normal_(0.0, 0.02)
            for t in (layer.conv_q, layer.conv_k, layer.conv_v):
                t.normal_()
    cache.set_lengths(context)


def median_event_ms(fn, reps: int) -> tuple[float, float]:
    """(median ms of single calls, mean ms per call over the back-to-back run), CUDA events around each call."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return statistics.median(times), starts[0].elapsed_time(ends[-1]) / reps


def count_kernels(fn) -> int | None:
    """GPU kernels launched by one call of fn (torch.profiler), or None when the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:
        log(f"  kernel count failed: {exc!r}")
        return None


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def decode_case(model, name: str, B: int, context: int, reps: int, with_eager: bool, pack: bool = True) -> dict:
    from hybrid_attention.inference.decode_graph import DecodeStep

    row = dict(model=name, B=B, context=context)
    per_token = model.cache_bytes_per_token(torch.bfloat16)
    state = model.state_bytes_per_sequence(torch.bfloat16)
    row["cache_bytes_per_seq"] = context * per_token + state
    margin = reps + 32  # every replay and eager step appends one token
    need = B * ((context + margin) * per_token + state) + 2 * 2**30  # plus ~2 GB of graph pool and workspace
    free, _ = torch.cuda.mem_get_info()
    if name == "all-mla" and B == 32 and context >= 524288:
        row["skipped"] = "all-MLA at 32 x 512K needs 126 GB of latent cache: does not fit next to anything else"
        return row
    if need > 0.92 * free:
        row["skipped"] = f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        return row
    cache = model.make_cache(B, context + margin)
    step = DecodeStep(model, cache, cuda_graph=True, pack_projections=pack)  # warm-up + capture, empty cache
    fill_cache(cache, context)
    step.tokens.copy_(torch.randint(0, model.config.vocab_size, (B, 1), device="cuda"))
    for _ in range(3):
        step.replay()
    row["ms"], row["ms_back_to_back"] = median_event_ms(step.replay, reps)
    row["tokens_per_s"] = B / row["ms"] * 1e3
    # Bytes a step cannot avoid: weights once, every valid latent row, KDA states read and written.
    step_bytes = weight_bytes(model) + B * (context * per_token + 2 * state)
    row["step_GB"] = step_bytes / 1e9
    row["GBps"] = step_bytes / row["ms"] / 1e6
    if with_eager:
        with torch.no_grad():
            eager = lambda: model(step.tokens, cache=cache)  # noqa: E731
            for _ in range(2):
                eager()
            row["eager_ms"], _ = median_event_ms(eager, 10)
            row["kernels_per_step"] = count_kernels(eager)
    return row  # the cache and graph are freed by the caller's free_memory() once they go out of scope


def kernel_case(B: int, context: int) -> dict:
    """The MLA decode kernel alone on one layer's full cache at k3-scaled sizes, timed as bench_mla_decode.py times
    it (same inputs, do_bench with the L2 flushed)."""
    from bench_mla_decode import D_C, SCALE, D, bench, make_inputs

    from hybrid_attention.ops.mla.decode import mla_decode

    q, rows, lens = make_inputs(B, context, 1)
    ms = bench(lambda: mla_decode(q, rows, lens, value_dim=D_C, scale=SCALE))
    gbytes = B * context * D * 2 / 1e9
    return dict(B=B, context=context, ms=ms, cache_GB=gbytes, TBps=gbytes / ms)


def prefill_case(model, name: str, context: int, chunk: int, repeat: bool = False) -> dict:
    """Seconds for one chunked prefill of `context` random tokens at batch 1. With `repeat` the same prefill runs
    once untimed first, so that one-off costs of new shapes (Triton autotuning, cuDNN attention plans for each new
    query / key length) stay out of the timing."""
    from hybrid_attention.inference.prefill import prefill

    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    if repeat:
        prefill(model, ids, model.make_cache(1, context), chunk_size=chunk)
        free_memory()
    cache = model.make_cache(1, context)
    torch.cuda.synchronize()
    start = time.perf_counter()
    prefill(model, ids, cache, chunk_size=chunk)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return dict(model=name, context=context, chunk=chunk, s=seconds, tokens_per_s=context / seconds, repeated=repeat)


def print_tables(decode, kernels, prefills) -> None:
    print("\nDecode (CUDA-graph replay, bf16; time per output token = one step for the whole batch)")
    print(f"{'model':8} {'B':>3} {'context':>8} {'ms/token':>9} {'tok/s':>9} {'cache MB/seq':>12} "
          f"{'step GB':>8} {'GB/s':>7} {'eager ms':>9} {'kernels':>8}  note")  # fmt: skip
    for r in decode:
        if "ms" not in r:
            print(f"{r['model']:8} {r['B']:>3} {r['context']:>8}  {r.get('skipped') or r.get('error')}")
            continue
        eager = f"{r['eager_ms']:.3f}" if "eager_ms" in r else ""
        kern = str(r.get("kernels_per_step") or "")
        print(f"{r['model']:8} {r['B']:>3} {r['context']:>8} {r['ms']:>9.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['cache_bytes_per_seq'] / 1e6:>12.1f} {r['step_GB']:>8.2f} {r['GBps']:>7.0f} "
              f"{eager:>9} {kern:>8}")  # fmt: skip
    print("\nHybrid speed-up per token over all-MLA")
    by = {(r["model"], r["B"], r["context"]): r for r in decode if "ms" in r}
    for (m, B, ctx), r in sorted(by.items()):
        if m == "hybrid" and ("all-mla", B, ctx) in by:
            print(f"  B={B:>2} context={ctx:>7}: {by[('all-mla', B, ctx)]['ms'] / r['ms']:.2f}x")
    print("\nMLA decode kernel alone (one layer, H=8, rows 288 x bf16; copy ceiling 4.27 TB/s)")
    for r in kernels:
        detail = f"{r['ms']:.3f} ms, {r['TBps']:.2f} TB/s" if "ms" in r else r.get("error", "")
        print(f"  B={r['B']:>2} context={r['context']:>8}: {detail}")
    print("\nPrefill at batch 1 (chunked, bf16)")
    for r in prefills:
        call = "second call" if r.get("repeated") else "first call"
        detail = f"{r['s']:.2f} s ({r['tokens_per_s']:,.0f} tokens/s, chunk {r['chunk']}, {call})" if "s" in r else ""
        print(f"  {r['model']:8} context={r['context']:>7}: {detail or r.get('skipped') or r.get('error')}")


def check_thresholds(decode, kernels, hybrid, all_mla) -> dict:
    """The benchmark's thresholds: batch-1 decoding at 4K within 0.25 ms per token, the hybrid's latent cache at most
    4/13 of all-MLA's, the MLA kernel at >= 3 TB/s from batch x context >= 1M on; and the hybrid's speed-up over
    all-MLA at 32 x 128K next to the ratio of the bytes the two steps must read, which bounds it."""
    by = {(r["model"], r["B"], r["context"]): r for r in decode if "ms" in r}
    out = {}
    r = by.get(("hybrid", 1, 4096))
    out["hybrid_B1_4K_ms_le_0.25"] = None if r is None else dict(ms=r["ms"], met=r["ms"] <= 0.25)
    h, m = by.get(("hybrid", 32, 131072)), by.get(("all-mla", 32, 131072))
    out["hybrid_speedup_at_128K_B32"] = (
        None if not (h and m) else dict(speedup=m["ms"] / h["ms"], bytes_ratio=m["step_GB"] / h["step_GB"])
    )
    ratio = hybrid.cache_bytes_per_token(torch.bfloat16) / all_mla.cache_bytes_per_token(torch.bfloat16)
    out["cache_ratio_le_4_13"] = dict(ratio=ratio, state_bytes=hybrid.state_bytes_per_sequence(), met=ratio <= 4 / 13)
    big = [k for k in kernels if "TBps" in k and k["B"] * k["context"] >= 2**20]
    out["mla_kernel_ge_3TBps"] = None if not big else dict(min_TBps=min(k["TBps"] for k in big),
                                                           met=min(k["TBps"] for k in big) >= 3.0)  # fmt: skip
    return out


def plot(decode, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"no plot: matplotlib unavailable ({exc!r})"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("hybrid", "-"), ("all-mla", "--")):
        for B, marker in ((1, "o"), (32, "s")):
            pts = sorted((r["context"], r["ms"]) for r in decode if r["model"] == name and r["B"] == B and "ms" in r)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, marker=marker, label=f"{name}, batch {B}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(f"k3-scaled decode on one {torch.cuda.get_device_name()}, bf16, CUDA graph")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="contexts 4K and 16K, fewer repetitions, prefill at 4K only")
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument(
        "--plot",
        default=str(Path(__file__).resolve().with_name("decode_latency.png")),
        help="PNG of time per token against context (default: decode_latency.png beside this script)",
    )
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting new prefill cases after this")
    p.add_argument("--reps", type=int, default=None, help="replays timed per decode case (default 50, quick 15)")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill call (default 8192)")
    p.add_argument("--no-pack", action="store_true", help="decode without packed projections (layers/packed.py)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    contexts = CONTEXTS[:2] if args.quick else CONTEXTS
    reps = args.reps or (15 if args.quick else 50)
    kda_backend = "auto"  # our Triton chunk kernels on CUDA (prefill only; decode is the recurrent step either way)
    result = dict(env=env_info(["benchmarks/bench_decode.py", *argv]), kda_prefill_backend=kda_backend)
    result["packed_projections"] = not args.no_pack
    result["env"]["budget_s"] = args.budget_s
    decode, kernels, prefills, failures = [], [], [], []
    models = {}
    for name, preset in MODELS.items():
        models[name] = build_model(preset, kda_backend)
        log(f"{name}: {sum(p.numel() for p in models[name].parameters()) / 1e6:.1f}M parameters")
    result["weights_GB"] = {n: weight_bytes(m) / 1e9 for n, m in models.items()}

    def attempt(label: str, record: dict, fn, *args, **kwargs) -> dict:
        """fn(*args, **kwargs) for one case; on failure record the error and keep going. Memory is freed either way."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            failures.append(f"{label}: {exc!r}"[:300])
            return dict(record, error=repr(exc)[:300])
        finally:
            free_memory()

    for name, model in models.items():
        for B in BATCHES:
            for ctx in contexts:
                log(f"decode {name} B={B} context={ctx} ({time.monotonic() - t0:.0f} s)")
                record = dict(model=name, B=B, context=ctx)
                eager = B == 1 and ctx == contexts[0]
                decode.append(
                    attempt(f"decode {record}", record, decode_case, model, name, B, ctx, reps, eager, not args.no_pack)
                )

    for B, ctx in [(32, 32768)] if args.quick else [(32, 32768), (32, 131072), (1, 1048576)]:
        kernels.append(attempt(f"kernel B={B} ctx={ctx}", dict(B=B, context=ctx), kernel_case, B, ctx))

    prefill_contexts = contexts[:1] if args.quick else contexts
    warm_len = 2 * args.prefill_chunk + 5  # warm-up (Triton compilation) outside the timings
    for name, model in models.items():
        warm = attempt(f"prefill warm-up {name}", {}, prefill_case, model, name, warm_len, args.prefill_chunk)
        if "error" in warm and any(layer.layer_type == "kda" for layer in model.layers):
            # Retry with the PyTorch reference chunk op before giving up on prefill timings.
            for layer in model.layers:
                if layer.layer_type == "kda":
                    layer.mixer.backend = "torch"
            result["kda_prefill_backend"] = "torch (auto failed)"
            attempt(f"prefill warm-up {name} (torch)", {}, prefill_case, model, name, warm_len, args.prefill_chunk)
        last = None
        for ctx in prefill_contexts:
            left = args.budget_s - (time.monotonic() - t0)
            repeat = ctx <= REPEAT_PREFILL_UP_TO
            calls = 2 if repeat else 1
            predicted = None if last is None else calls * last["s"] * (ctx / last["context"]) ** 2
            # The first model gets half of what is left, so the second still runs after its long contexts.
            share = left / 2 if name == next(iter(models)) else left
            if predicted is not None and predicted > share:
                skipped = f"predicted {predicted:.0f} s > {share:.0f} s left in the budget"
                prefills.append(dict(model=name, context=ctx, skipped=skipped))
                continue
            log(f"prefill {name} context={ctx} ({time.monotonic() - t0:.0f} s)")
            record = dict(model=name, context=ctx)
            row = attempt(f"prefill {record}", record, prefill_case, model, name, ctx, args.prefill_chunk, repeat)
            prefills.append(row)
            last = row if "s" in row else last

    print_tables(decode, kernels, prefills)
    result.update(decode=decode, mla_kernel=kernels, prefill=prefills, failures=failures)
    result["thresholds"] = check_thresholds(decode, kernels, models["hybrid"], models["all-mla"])
    result["plot"] = plot(decode, args.plot) if args.plot else None
    result["elapsed_s"] = time.monotonic() - t0
    print("\nThresholds:", json.dumps(result["thresholds"]))
    print(f"Failures: {len(failures)}" + "".join(f"\n  {f}" for f in failures))
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
