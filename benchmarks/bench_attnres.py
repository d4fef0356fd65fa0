"""Benchmark: the fused AttnRes training ops against the readable reference and against a standard residual, on one
GPU, bf16 sources and float32 parameters (as under bf16 autocast), forward and forward+backward.

Parts (select with --parts):
  op      one op at D = 1024: Full AttnRes + RMSNorm over S sources (fused `attn_res_norm_train`, the reference
          `rms_norm(naive_attn_res(list))`, and what a standard residual step costs on the same path,
          `rms_norm(h + y)` with a float32 h), Block AttnRes phase 1 over N blocks for Q = 4 queries, and phase 2
          (merge + RMSNorm).
  stream  the residual stream of the k3-scaled depth alone (26 sublayers + the final norm, each sublayer a cheap
          elementwise scale so that only the residual wiring is measured): standard residual, Full AttnRes and
          Block AttnRes (blocks of 4), fused and reference; time and peak memory of forward+backward.

Timing: `triton.testing.do_bench` medians; gradients through `torch.autograd.grad` (no accumulation). "host ms" is
the median time the host takes to enqueue one call (from an idle GPU, no synchronisation inside): when it comes close
to "ms", the case is bound by Python and launch overhead, not by the GPU. Every case runs in try/except (failures
are listed, the run goes on).

    python benchmarks/bench_attnres.py --out bench_attnres.json            # both parts, both shapes
    python benchmarks/bench_attnres.py --quick                                   # B x T = 8 x 2048 only

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_common import emit_json, env_info, log

from hybrid_attention.layers.attnres import AttnRes
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.stream import block_attn_res_stream, full_attn_res_stream, residual_stream
from hybrid_attention.ops.attnres.block_stream import attn_res_merge_norm_train, attn_res_partial_train
from hybrid_attention.ops.attnres.mix_norm_grad import attn_res_norm_train
from hybrid_attention.ops.attnres.naive import naive_attn_res, naive_attn_res_merge, naive_attn_res_partial
from hybrid_attention.ops.numerics import rms_norm

D = 1024
SHAPES = [(8, 2048), (1, 16384)]
SUBLAYERS = 26  # k3-scaled: 13 layers x (mixer, MLP)
BLOCK = 4  # the k3-scaled-block preset


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def host_ms(fn, reps: int = 20) -> float:
    """Median host time of one call of fn, each started on an idle GPU, ms."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2] * 1e3


def peak_mib(fn) -> float:
    """Peak memory allocated by one call of fn above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fwd_bwd(forward, inputs):
    """A callable running forward() and the gradient of every input (a fixed random cotangent)."""
    out = forward()
    cot = torch.randn_like(out)

    def run():  # allow_unused: the standard stream has no final AttnRes
        torch.autograd.grad(forward(), inputs, cot, allow_unused=True)

    return run


def sources(n, B, T, dtype=torch.bfloat16):
    return [torch.randn(B, T, D, device="cuda", dtype=dtype).requires_grad_() for _ in range(n)]


def params(*shape):
    return [torch.randn(*shape, device="cuda").requires_grad_() for _ in range(3)]


def op_cases(B, T):
    """(name, {variant: fn}) for the op part."""
    cases = []
    for S in (2, 14, 27):
        src = sources(S, B, T)
        q, kw, nw = params(D)
        fused = lambda src=src, q=q, kw=kw, nw=nw: attn_res_norm_train(src, q, kw, nw)
        ref = lambda src=src, q=q, kw=kw, nw=nw: rms_norm(naive_attn_res(src, q, kw), nw, 1e-6)
        h = torch.randn(B, T, D, device="cuda").requires_grad_()
        std = lambda h=h, y=src[-1], nw=nw: rms_norm(h + y, nw, 1e-6)
        variants = {
            "fused fwd": fused,
            "fused fwd+bwd": fwd_bwd(fused, [*src, q, kw, nw]),
            "reference fwd+bwd": fwd_bwd(ref, [*src, q, kw, nw]),
            "standard fwd+bwd": fwd_bwd(std, [h, src[-1], nw]),
        }
        cases.append((f"full S={S}", variants))
    for N in (2, 8):
        blk = sources(N, B, T)
        qs, kws = (torch.randn(4, D, device="cuda").requires_grad_() for _ in range(2))
        fused = lambda blk=blk, qs=qs, kws=kws: torch.stack(attn_res_partial_train(blk, qs, kws)[0])
        ref = lambda blk=blk, qs=qs, kws=kws: torch.stack(
            [naive_attn_res_partial(blk, qs[i], kws[i])[0] for i in range(4)]
        )
        variants = {
            "fused fwd+bwd": fwd_bwd(fused, [*blk, qs, kws]),
            "reference fwd+bwd": fwd_bwd(ref, [*blk, qs, kws]),
        }
        cases.append((f"phase 1 N={N} Q=4", variants))
    blk = sources(4, B, T)
    with torch.no_grad():
        out0, lse0 = naive_attn_res_partial(blk[:3], *params(D)[:2])
    out, lse = out0.requires_grad_(), lse0.requires_grad_()
    q, kw, nw = params(D)
    fused = lambda: attn_res_merge_norm_train(out, lse, blk[3], q, kw, nw)
    ref = lambda: rms_norm(naive_attn_res_merge(out, lse, blk[3], q, kw), nw, 1e-6)
    inputs = [out, lse, blk[3], q, kw, nw]
    variants = {"fused fwd+bwd": fwd_bwd(fused, inputs), "reference fwd+bwd": fwd_bwd(ref, inputs)}
    cases.append(("phase 2 + norm", variants))
    return cases


def make_steps():
    """26 sublayers g(x) = x * c (a new bf16 tensor per sublayer, as a real output), each with its AttnRes (none on
    the first, which reads the embedding alone) and RMSNorm, then the final AttnRes and norm."""
    steps, ps = [], []
    for i in range(SUBLAYERS + 1):
        res, norm = (AttnRes(D).cuda() if i else None), RMSNorm(D).cuda()
        if res is not None:
            res.query.data.normal_(0, D**-0.5)
        c = torch.randn(D, device="cuda").requires_grad_()
        g = None if i == SUBLAYERS else (lambda x, c=c: (x * c).to(torch.bfloat16))
        steps.append((res, norm, g))
        ps += [*(res.parameters() if res is not None else []), *norm.parameters()] + ([c] if g is not None else [])
    return steps, ps


def stream_cases(B, T):
    steps, ps = make_steps()
    standard_steps = [(None, norm, g) for _, norm, g in steps]
    emb = torch.randn(B, T, D, device="cuda").requires_grad_()
    emb16 = emb.detach().bfloat16().requires_grad_()
    variants = {
        "standard": lambda: residual_stream("standard", emb, standard_steps),
        "full fused": lambda: full_attn_res_stream(emb, steps),
        "full reference": lambda: residual_stream("attnres", emb16, steps, backend="torch"),
        f"block {BLOCK} fused": lambda: block_attn_res_stream(emb, steps, BLOCK),
        f"block {BLOCK} reference": lambda: residual_stream(
            "block_attnres", emb16, steps, block_size=BLOCK, backend="torch"
        ),
    }
    inputs = lambda name: [emb16 if "reference" in name else emb, *ps]
    return [("stream fwd+bwd", {k: fwd_bwd(f, inputs(k)) for k, f in variants.items()})]


def main(argv) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="op,stream", help="comma-separated: op, stream")
    p.add_argument("--quick", action="store_true", help="B x T = 8 x 2048 only")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attnres: needs a CUDA GPU")
    result = dict(env_info(sys.argv), rows=[], failures=[])
    print(f"{'shape':>12} {'case':>20} {'variant':>22} {'ms':>9} {'host ms':>9} {'peak MiB':>9}")
    for B, T in SHAPES[:1] if args.quick else SHAPES:
        for part in args.parts.split(","):
            try:
                cases = op_cases(B, T) if part == "op" else stream_cases(B, T)
            except Exception as e:  # noqa: BLE001 - a failing case is listed, not fatal
                result["failures"].append(dict(shape=[B, T], part=part, error=repr(e)))
                log(f"{part} {B}x{T}: {e!r}")
                continue
            for case, variants in cases:
                for variant, fn in variants.items():
                    try:
                        ms = bench(fn)
                        host = host_ms(fn)
                        mib = peak_mib(fn)
                    except Exception as e:  # noqa: BLE001
                        result["failures"].append(dict(shape=[B, T], case=case, variant=variant, error=repr(e)))
                        log(f"{case} {variant}: {e!r}")
                        continue
                    row = dict(
                        B=B, T=T, case=case, variant=variant, ms=round(ms, 4), host_ms=round(host, 4),
                        peak_mib=round(mib, 1),
                    )  # fmt: skip
                    result["rows"].append(row)
                    print(f"{f'{B}x{T}':>12} {case:>20} {variant:>22} {ms:9.3f} {host:9.3f} {mib:9.1f}", flush=True)
            torch.cuda.empty_cache()
    emit_json(result, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
