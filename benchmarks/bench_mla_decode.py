"""Benchmark: absorbed MLA decode over the latent cache (our Triton kernel) against PyTorch SDPA, side by side.

One decode step at k3-scaled MLA sizes: H=8 heads, cache rows D = d_c + d_s = 256 + 32 = 288, values the first 256
columns, bf16. Every sequence is full (seq_lens = context), so the step must read B * ctx * D * 2 bytes of cache;
the table reports that over the median time (`triton.testing.do_bench`, L2 flushed before each call) against an
H200's 4.27 TB/s device copy rate (docs/performance.md). "graph" replays the call from a CUDA graph (no Python
launch cost), as the decode loop does. SDPA baseline: heads folded into the query axis (q [B, 1, H*Tq, D], k = rows,
v = rows[..., :256], explicit scale, additive mask built from the lengths outside the timed region), forced onto the
memory-efficient backend when it accepts the shapes.

    python benchmarks/bench_mla_decode.py [--out results.json] [--tq 1] [--tune]

Prints a table, then one JSON line (also written to --out). --tune sweeps split counts and kernel configs on a few
shapes and prints the best ones.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_common import emit_json, env_info

H, D_C, D_S, D_N = 8, 256, 32, 96
D = D_C + D_S
SCALE = (D_N + D_S) ** -0.5
COPY_CEILING_GBS = 4270.0
CONTEXTS = {1: [4096, 16384, 65536, 131072, 262144, 524288, 1048576], 32: [4096, 16384, 32768, 65536, 131072, 524288]}


def bench(fn) -> float:
    """Median milliseconds of fn() with triton's do_bench (L2 flushed between calls)."""
    from triton.testing import do_bench

    t = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return float(t[0] if isinstance(t, (list, tuple)) else t)


def bench_graph(fn) -> float:
    """Median ms of one CUDA-graph replay of fn (captured after a warm-up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def make_inputs(B: int, ctx: int, Tq: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(B * 7919 + ctx)
    q = torch.randn(B, Tq, H, D, device="cuda", dtype=dtype, generator=g)
    rows = torch.randn(B, ctx, D, device="cuda", dtype=dtype, generator=g)
    seq_lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    return q, rows, seq_lens


def sdpa_setup(q, rows, seq_lens):
    """SDPA with heads folded into queries; returns a zero-argument callable, or None if no backend runs it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, Tq, Hq, _ = q.shape
    N = rows.shape[1]
    qf = q.reshape(B, 1, Tq * Hq, D)
    k = rows.unsqueeze(1)
    v = rows[..., :D_C].unsqueeze(1)
    # Bottom-right causal over each length; query row m = t * H + h sits at seq_lens[b] - Tq + t.
    t = torch.arange(Tq, device=q.device).repeat_interleave(Hq)  # (Tq*H,)
    last = seq_lens.long()[:, None] - Tq + t[None, :]  # (B, Tq*H)
    keys = torch.arange(N, device=q.device)
    if Tq == 1:  # every head sees the same keys: a broadcast mask [B, 1, 1, N], as a server would pass
        last = last[:, :1]
    visible = keys[None, None, :] <= last[:, :, None]
    mask = torch.zeros(visible.shape, device=q.device, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    mask = mask.unsqueeze(1).expand(B, 1, Tq * Hq, N)
    for backends, label in (([SDPBackend.EFFICIENT_ATTENTION], "sdpa-efficient"), (None, "sdpa-default")):

        def fn(backends=backends):
            if backends is None:
                return F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=SCALE)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=SCALE)

        try:
            fn()
            torch.cuda.synchronize()
            return fn, label
        except (RuntimeError, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
    return None, "n/a"


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(B: int, ctx: int, Tq: int, with_sdpa: bool):
    from hybrid_attention.ops.mla.decode import mla_decode
    from hybrid_attention.ops.mla.triton_decode import launch_plan

    q, rows, seq_lens = make_inputs(B, ctx, Tq)
    gbytes = B * ctx * D * 2 / 1e9
    fn = lambda: mla_decode(q, rows, seq_lens, value_dim=D_C, scale=SCALE)  # noqa: E731
    out = fn()
    plan = launch_plan(q, rows, value_dim=D_C)
    row = dict(B=B, ctx=ctx, Tq=Tq, cache_GB=round(gbytes, 4), num_splits=plan["num_splits"], block_n=plan["block_n"])
    row["ms"] = bench(fn)
    row["GBps"] = gbytes / row["ms"] * 1e3
    try:
        row["graph_ms"] = bench_graph(fn)
        row["graph_GBps"] = gbytes / row["graph_ms"] * 1e3
    except Exception as e:  # report, keep going
        row["graph_ms"], row["graph_error"] = None, str(e)[:200]
    if with_sdpa:
        sfn, label = sdpa_setup(q, rows, seq_lens)
        row["sdpa_backend"] = label
        if sfn is not None:
            ref = sfn()  # [B, 1, Tq*H, D_C]
            row["err_vs_sdpa"] = rel_err(out.reshape(B, 1, Tq * H, D_C), ref)
            row["sdpa_ms"] = bench(sfn)
            row["sdpa_GBps"] = gbytes / row["sdpa_ms"] * 1e3
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["ms"]
    elif ctx <= 65536:  # still check the answer against the PyTorch path
        ref = mla_decode(q, rows, seq_lens, value_dim=D_C, scale=SCALE, backend="torch")
        row["err_vs_torch"] = rel_err(out, ref)
    return row  # the inputs are freed when this returns


def tune_shape(B: int, ctx: int, Tq: int):
    """Time split counts around the default times (block_n, num_warps, num_stages) configs for one shape."""
    from hybrid_attention.ops.mla.triton_decode import launch_plan, mla_decode_triton

    configs = [(32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 8, 2)]
    q, rows, seq_lens = make_inputs(B, ctx, Tq)
    gbytes = B * ctx * D * 2 / 1e9
    ref = mla_decode_triton(q, rows, seq_lens, value_dim=D_C, scale=SCALE)
    base = launch_plan(q, rows, value_dim=D_C)["num_splits"]
    results = []
    for ns in sorted({1, max(1, base // 4), max(1, base // 2), base, base * 2}):
        for bn, nw, st in configs:
            kw = dict(value_dim=D_C, scale=SCALE, num_splits=ns, block_n=bn, num_warps=nw, num_stages=st)
            fn = lambda kw=kw: mla_decode_triton(q, rows, seq_lens, **kw)  # noqa: E731
            try:
                o = fn()
                torch.cuda.synchronize()
                ms = bench(fn)
            except Exception as e:  # e.g. out of shared memory for this config
                print(f"  B={B} ctx={ctx} splits={ns} cfg={(bn, nw, st)}: {type(e).__name__}", file=sys.stderr)
                continue
            results.append(
                dict(
                    B=B,
                    ctx=ctx,
                    splits=ns,
                    block_n=bn,
                    warps=nw,
                    stages=st,
                    ms=ms,
                    GBps=gbytes / ms * 1e3,
                    err=rel_err(o, ref),
                )
            )
    results.sort(key=lambda r: r["ms"])
    print(f"\ntune B={B} ctx={ctx} (default splits {base}): best 5 of {len(results)}")
    for r in results[:5]:
        print(
            f"  splits={r['splits']:4d} block_n={r['block_n']:3d} warps={r['warps']} stages={r['stages']}"
            f"  {r['ms'] * 1e3:9.1f} us  {r['GBps']:7.0f} GB/s  err {r['err']:.1e}"
        )
    return results


def tune(Tq: int):
    """Sweep split counts and kernel configs on a few shapes; print the best per shape."""
    results = []
    for B, ctx in ((1, 524288), (1, 65536), (32, 32768), (32, 4096), (32, 131072)):
        results += tune_shape(B, ctx, Tq)
        torch.cuda.empty_cache()
    return results


def fmt(x, spec, scale=1.0):
    """format(x * scale, spec), or a dash padded to the same width when x is missing."""
    return format(x * scale, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=str, default=None, help="also write the JSON result to this path")
    ap.add_argument("--tq", type=int, default=1, help="query tokens per sequence (1 = plain decode)")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 32], help="batch sizes")
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="override the context lengths")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    ap.add_argument("--tune", action="store_true", help="also sweep split counts and kernel configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_decode: needs a CUDA GPU")

    rows = []
    header = (
        f"{'B':>3} {'ctx':>8} {'Tq':>2} {'GB':>7} {'splits':>6} | {'ours us':>9} {'GB/s':>6} {'%ceil':>5} | "
        f"{'graph us':>9} {'GB/s':>6} {'%ceil':>5} | {'sdpa us':>9} {'GB/s':>6} {'x':>5} | {'err':>7}"
    )
    print(
        f"MLA decode, bf16, H={H}, D={D}, value_dim={D_C}, Tq={args.tq}; GB/s = cache bytes read / median time; "
        f"ceiling {COPY_CEILING_GBS / 1e3:.2f} TB/s"
    )
    print(header)
    print("-" * len(header))
    for B in args.batch:
        for ctx in args.contexts or CONTEXTS.get(B, CONTEXTS[32]):
            need = B * ctx * D * 2 * 1.3 + B * args.tq * H * ctx * 2 * 2  # cache + SDPA mask, with slack
            free, _ = torch.cuda.mem_get_info()
            if need > 0.8 * free:
                print(f"{B:>3} {ctx:>8} skipped: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
                continue
            try:
                r = run_case(B, ctx, args.tq, not args.no_sdpa)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"{B:>3} {ctx:>8} skipped: out of memory")
                continue
            rows.append(r)
            err = r.get("err_vs_sdpa", r.get("err_vs_torch"))
            print(
                f"{B:>3} {ctx:>8} {args.tq:>2} {r['cache_GB']:>7.3f} {r['num_splits']:>6} | "
                f"{fmt(r['ms'], '9.1f', 1e3)} {r['GBps']:>6.0f} {100 * r['GBps'] / COPY_CEILING_GBS:>5.1f} | "
                f"{fmt(r.get('graph_ms'), '9.1f', 1e3)} {fmt(r.get('graph_GBps'), '6.0f')} "
                f"{fmt(r.get('graph_GBps'), '5.1f', 100 / COPY_CEILING_GBS)} | "
                f"{fmt(r.get('sdpa_ms'), '9.1f', 1e3)} {fmt(r.get('sdpa_GBps'), '6.0f')} "
                f"{fmt(r.get('speedup_vs_sdpa'), '5.1f')} | {fmt(err, '7.1e')}",
                flush=True,
            )
    big = [r for r in rows if r["B"] * r["ctx"] >= 1 << 20]
    if big:
        worst = min(max(r["GBps"], r.get("graph_GBps") or 0.0) for r in big)
        print(f"\nbatch x context >= 1M tokens: worst {worst:.0f} GB/s (threshold >= 3000 GB/s)")
    tuned = tune(args.tq) if args.tune else None

    result = dict(
        bench="mla_decode",
        **env_info(sys.argv),
        shape=dict(H=H, D=D, value_dim=D_C, Tq=args.tq, dtype="bfloat16", scale=SCALE),
        copy_ceiling_GBps=COPY_CEILING_GBS,
        rows=rows,
        tune=tuned,
    )
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
