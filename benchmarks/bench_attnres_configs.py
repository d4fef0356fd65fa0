"""Benchmark: every launch shape of the Full AttnRes stream kernels, each alone, at the k3-scaled training size.

The stream's forward (`_full_fwd_kernel`, one program per row) over S sources, the stream step's local kernel
(`_stream_local_kernel`, its own RMSNorm backward), and the backward of one stream step (the local kernel at its
tuned shape, then `_stream_bwd_kernel`, which assembles the gradient of its newest source from the dh rows of the
later steps), at M = 8 x 2048 rows, D = 1024, bf16 sources, K = 27 steps (the k3-scaled depth). Each launch shape
runs alone, bypassing the autotuner, so the table shows what the tuner chooses between (the one-step backward's are
the assembly kernel's (BLOCK_M, num_warps, STAGES) configs); the assembly at 8 and 16 programs per SM
(`STREAM_BWD_PROGRAMS_PER_SM`, --per-sm); and the step's dL/du product (`add_dzr_products_`, replayed from a CUDA
graph: its host work outlasts its kernel). Times are `triton.testing.do_bench` medians in microseconds.

    python benchmarks/bench_attnres_configs.py --out bench_attnres_configs.json

Prints one line per case, fastest first, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from bench_common import emit_json, env_info, log

M, D, K = 8 * 2048, 1024, 27
EPS = 1e-6


def _launcher(kernel, grid, *args, **meta):
    """One launch of the tuned kernel's JIT function with fixed launch parameters (the autotuner bypassed)."""
    return lambda: kernel.fn[grid](*args, **meta)


def _time_us(fn, graph: bool = False) -> float:
    """The median time of fn() in microseconds; with `graph`, replayed from a CUDA graph (for a call whose host work
    would outlast its kernel)."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return (do_bench_cudagraph(fn, rep=60) if graph else do_bench(fn, warmup=20, rep=60)) * 1000
    except Exception as exc:  # a launch shape the compiler refuses: listed, not fatal
        log(f"  failed: {exc!r:.120}")
        return float("nan")


def forward_sweep(sources, queries, key_ws, norm_w, counts, aligns) -> dict:
    import triton.language as tl

    from hybrid_attention.ops.attnres.rows import pointer_table, residual_scale, source_bucket
    from hybrid_attention.ops.attnres.triton_mix_norm import FULL_FWD_CONFIGS, _full_fwd_kernel
    from hybrid_attention.ops.triton_support import split_scalar

    out, h = torch.empty_like(sources[0]), torch.empty_like(sources[0])
    h_res = torch.empty_like(sources[0], dtype=torch.int8)  # h's rounding residual, kept for the stream backward
    stats = torch.empty(2, M, device=out.device)
    results = {}
    for S in counts:
        table = pointer_table(sources[:S])
        logits = torch.empty(S, M, device=out.device)  # a stream step keeps its logits for the backward
        for align, (block_s, warps, stages) in itertools.product(aligns, FULL_FWD_CONFIGS):
            launch = _launcher(
                _full_fwd_kernel, (M,), table, sources[0], queries[0], key_ws[0], norm_w, out, h, h_res, stats,
                logits, M, S, D, *split_scalar(EPS), *split_scalar(EPS), source_bucket(S), SAVE_H=True, SAVE_Z=True,
                RES_SCALE=residual_scale(out.dtype), CDT=tl.float32, ALIGN=align, BLOCK_S=block_s, STAGES=stages,
                BLOCK_D=D, num_warps=warps,
            )  # fmt: skip
            results[f"S={S} ALIGN={align} BLOCK_S={block_s} warps={warps} STAGES={stages}"] = _time_us(launch)
    return results


def backward_sweep(sources, queries, key_ws, norm_w, steps, per_sms) -> dict:
    import triton.language as tl

    from hybrid_attention.ops.attnres.full_stream import early_steps
    from hybrid_attention.ops.attnres.rows import residual_scale, source_bucket
    from hybrid_attention.ops.attnres.triton_stream_bwd import (
        COPY_BLOCK,
        STREAM_BWD_CONFIGS,
        STREAM_LOCAL_CONFIGS,
        _stream_bwd_kernel,
        _stream_local_kernel,
        add_dzr_products_,
        param_table_rows,
    )
    from hybrid_attention.ops.triton_support import row_programs, split_scalar

    dev = sources[0].device
    gen = torch.Generator(device=dev).manual_seed(1)
    dx = torch.randn(M, D, device=dev, dtype=torch.bfloat16, generator=gen)
    h = torch.randn(M, D, device=dev, dtype=torch.bfloat16, generator=gen)
    h_res = torch.randint(-127, 128, (M, D), device=dev, dtype=torch.int8, generator=gen)
    stats = torch.rand(2, M, device=dev, generator=gen) + 0.5
    dh = torch.randn(K, M, D, device=dev, dtype=torch.bfloat16, generator=gen) * 0.01
    k_split = early_steps(K)
    dh_early, dh_late = dh[:k_split], dh[k_split:]  # the stream's two dh tables, as views of one
    rows = torch.rand(K, 2 + K, M, device=dev, generator=gen)  # c, lse, then the logits of K sources
    splits, local_programs = param_table_rows(M, dev)
    cols = torch.randn(1 + splits + local_programs, K, D, device=dev, generator=gen)  # u, dL/du and d norm_w parts
    dv = torch.empty(1, M, D, device=dev, dtype=torch.bfloat16)
    results = {}
    for k in steps:
        source = sources[k]  # a stream step assembles one source, passed itself (DIRECT)
        dzr = torch.randn(1, 2, K - k, M, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.rand(k + 1, M, device=dev, generator=gen)
        local_args = (dx, h, h_res, stats, queries, key_ws, norm_w, logits, dh[k], rows, cols, cols[1 + splits :], M, D)
        local_args += (2 + K, K, k, logits.numel())
        local_consts = dict(HAS_DX=True, CDT=tl.float32, COPY_BLOCK=COPY_BLOCK, BLOCK_D=D)
        local_consts["RES_SCALE"] = residual_scale(h.dtype)
        _stream_local_kernel[(local_programs,)](*local_args, **local_consts)  # tunes it
        best = _stream_local_kernel.best_config
        # The step's own rows of the tables at the tuned launch shape, without the tuner's host work: part of every
        # timed assembly call.
        local = _launcher(
            _stream_local_kernel, (local_programs,), *local_args, **local_consts, **best.kwargs,
            num_warps=best.num_warps, num_stages=best.num_stages,
        )  # fmt: skip
        results[f"step={k} later={K - 1 - k} the local kernel alone (tuned)"] = _time_us(local)
        for block_m, warps, stages in STREAM_LOCAL_CONFIGS:
            alone = _launcher(
                _stream_local_kernel, (local_programs,), *local_args, **local_consts, BLOCK_M=block_m, STAGES=stages,
                num_warps=warps,
            )  # fmt: skip
            name = f"step={k} the local kernel BLOCK_M={block_m} warps={warps} STAGES={stages}"
            results[name] = _time_us(alone)
        # The dL/du product adds into its partial sums: timing it again and again only changes their values.
        results[f"step={k} later={K - 1 - k} the dL/du product"] = _time_us(
            lambda dzr=dzr, source=source, k=k: add_dzr_products_([source], dzr, cols[1 : 1 + splits], k), graph=True
        )
        for per_sm, (block_m, warps, stages) in itertools.product(per_sms, STREAM_BWD_CONFIGS):
            assemble = _launcher(
                _stream_bwd_kernel, (row_programs(M, dev, per_sm),), source, dv, dh_early, dh_late, rows, cols, dzr,
                M, D, 2 + K, K, k, k_split, k, 1, *split_scalar(EPS), source_bucket(K - k), DIRECT=True,
                SPLIT_DZR=True, CDT=tl.float32, ALIGN=16, BLOCK_M=block_m, STAGES=stages, BLOCK_D=D, num_warps=warps,
            )  # fmt: skip
            name = f"step={k} later={K - 1 - k} per_sm={per_sm} BLOCK_M={block_m} warps={warps} STAGES={stages}"
            results[name] = _time_us(lambda assemble=assemble, local=local: (local(), assemble()))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="8,27", help="source counts of the forward cases")
    parser.add_argument("--steps", default="13,25", help="stream steps k of the backward cases (of 27)")
    parser.add_argument(
        "--aligns", default="16", help="ALIGN values of the forward's source tables (1: no alignment hint)"
    )
    parser.add_argument("--per-sm", default="8,16", help="backward programs per SM to time each config at")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("bench_attnres_configs: needs a CUDA GPU")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    sources = [torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(K)]
    queries = torch.randn(K, D, device="cuda", generator=gen) * D**-0.5
    key_ws = torch.rand(K, D, device="cuda", generator=gen) + 0.5
    norm_w = torch.rand(D, device="cuda", generator=gen) + 0.5
    result = {"env": env_info(sys.argv)}
    counts, steps = ([int(x) for x in arg.split(",")] for arg in (args.counts, args.steps))
    aligns = [int(a) for a in args.aligns.split(",")]
    if any(a not in (1, 16) for a in aligns):
        parser.error(f"--aligns takes 1 and 16, got {args.aligns}")
    result["forward_us"] = forward_sweep(sources, queries, key_ws, norm_w, counts, aligns)
    per_sms = [int(x) for x in args.per_sm.split(",")]
    result["backward_us"] = backward_sweep(sources, queries, key_ws, norm_w, steps, per_sms)
    for part in ("forward_us", "backward_us"):
        log(f"## {part}, fastest first")
        for name, t in sorted(result[part].items(), key=lambda kv: (kv[0].split(" ")[0], kv[1])):
            log(f"  {name:<66} {t:9.1f}")
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
