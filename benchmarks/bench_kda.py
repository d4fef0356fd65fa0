"""Benchmark: our Triton KDA kernels against FLA 0.6.0 and causal SDPA on one GPU, bf16, side by side in one run.

Parts (select with --parts):
  op      chunk op at the shapes OP_SHAPES [B, T, H, D]: ours (`chunk_kda_triton`, gate and q/k l2norm fused),
          FLA `chunk_kda` in its fastest path (safe_gate=True, lower_bound=-5, use_gate_in_kernel=True,
          use_qk_l2norm_in_kernel=True, A_log, dt_bias: the same configuration) and causal SDPA (flash); with
          impls ours-softplus / fla-softplus, the unbounded softplus gate (A_log = log 8, decays far below -5, so
          our pair-by-pair rows run; FLA's default safe_gate=False path).
          Modes: fwd (inference, no autograd), fwd+bwd (inputs require grad, o.backward(do)), fwd-train (the
          forward alone with autograd on, i.e. also saving for the backward; not in --quick).
  decode  one decode token from a float32 state, H=16, D=128, batch 1, 64, 256: ours (`fused_recurrent_kda_step`,
          state updated in place) against FLA `fused_recurrent_kda` (same flags); GB/s = state bytes read + written.
  layer   the whole KimiDeltaAttention layer, hidden 2048, 16 heads x 128, B=8, T=4096, ours (backend="triton")
          against FLA's layer (safe_gate=True, lower_bound=-5); fwd and fwd+bwd.

Timing: `triton.testing.do_bench` medians (warm-up 25 ms, 100 ms of repetitions), fresh random inputs per shape.
Every case runs in try/except (failures are listed, the run goes on), the JSON is rewritten to --out after every
case, and no new case starts once --budget seconds have passed, so a run cut short still leaves its numbers.

    python benchmarks/bench_kda.py --quick --out bench_kda.json      # standard shape, decode, layer (< 10 min)
    python benchmarks/bench_kda.py --out bench_kda.json              # everything

Prints a table, then one JSON line; the benchmark's thresholds (parity with FLA, decode bandwidth) come last.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from bench_common import env_info, log

OP_SHAPES = [(8, 4096, 16, 128), (2, 16384, 16, 128), (1, 65536, 16, 128), (32, 1024, 16, 128), (8, 4096, 32, 64)]
DECODE_BATCHES = [1, 64, 256]


def bench(fn, grads=None) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("inf")


def op_inputs(B, T, H, D):
    """Raw q, k (normalised in the kernels), v, gate logits z, beta = sigmoid(.), A_log = 0, dt_bias as the layer."""
    dev, dt = "cuda", torch.bfloat16
    q, k, v, z = (torch.randn(B, T, H, D, device=dev, dtype=dt) for _ in range(4))
    beta = torch.rand(B, T, H, device=dev, dtype=dt)
    A_log = torch.zeros(H, device=dev)
    dt_bias = torch.log(torch.expm1(torch.exp(-6.9 + 4.6 * torch.rand(H * D, device=dev))))
    return q, k, v, z, beta, A_log, dt_bias


def ours_op(q, k, v, z, beta, A_log, dt_bias):
    from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton

    return chunk_kda_triton(q, k, v, z, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                            use_qk_l2norm=True)[0]  # fmt: skip


def ours_softplus_op(q, k, v, z, beta, A_log, dt_bias):
    from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton

    return chunk_kda_triton(q, k, v, z, beta, gate="softplus", A_log=A_log + math.log(8.0), dt_bias=dt_bias,
                            use_qk_l2norm=True)[0]  # fmt: skip


def fla_softplus_op(q, k, v, z, beta, A_log, dt_bias):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, z, beta, A_log=A_log + math.log(8.0), dt_bias=dt_bias, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True)[0]  # fmt: skip


def fla_op(q, k, v, z, beta, A_log, dt_bias):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, z, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)[0]  # fmt: skip


def sdpa_op(q, k, v, *_):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q, k, v given as [B, H, T, D]


def time_modes(fn, inputs, modes, grad_idx, params=()):
    """{mode: ms} for fn(*inputs); fwd+bwd differentiates w.r.t. inputs[grad_idx] (and fn's own `params`, whose
    .grad is cleared before every timed call like the inputs', so no call pays for accumulating into the last)."""
    out = {}
    if "fwd" in modes:
        with torch.no_grad():
            out["fwd"] = bench(lambda: fn(*inputs))
    leaves = [x.detach().requires_grad_(i in grad_idx) for i, x in enumerate(inputs)]
    if "fwd-train" in modes:
        out["fwd-train"] = bench(lambda: fn(*leaves))
    if "fwd+bwd" in modes:
        do = torch.randn_like(fn(*leaves))
        out["fwd+bwd"] = bench(lambda: fn(*leaves).backward(do), grads=[leaves[i] for i in grad_idx] + list(params))
    return out


class Run:
    def __init__(self, args, argv):
        self.args, self.t0 = args, time.time()
        self.result = dict(env=env_info(argv), op=[], decode=[], layer=[], failures=[], skipped=[], thresholds={})

    def time_left(self) -> bool:
        return time.time() - self.t0 < self.args.budget

    def save(self) -> None:
        if self.args.out:
            with open(self.args.out, "w") as f:
                json.dump(self.result, f)

    def case(self, part: str, name: str, fn) -> None:
        """Run one case, recording its row, or the failure, or that the budget ran out."""
        if not self.time_left():
            self.result["skipped"].append(f"{part} {name}: time budget")
            log(f"[skip] {part} {name}: time budget")
            return
        log(f"[run] {part} {name} ({time.time() - self.t0:.0f} s)")
        try:
            row = fn()
            self.result[part].append(row)
            log(f"      {row}")
        except Exception as exc:
            self.result["failures"].append(f"{part} {name}: {type(exc).__name__}: {str(exc)[:400]}")
            log(f"[fail] {part} {name}: {type(exc).__name__}: {exc}")
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            self.save()


def op_case(shape, impls, modes):
    B, T, H, D = shape
    torch.manual_seed(0)
    inputs = op_inputs(B, T, H, D)
    row = dict(shape=list(shape))
    grad_idx = (0, 1, 2, 3, 4, 5, 6)
    outs = {}
    ops = (("ours", ours_op), ("fla", fla_op), ("ours-softplus", ours_softplus_op), ("fla-softplus", fla_softplus_op))
    for impl, fn in ops:
        if impl not in impls:
            continue
        try:
            row[impl] = time_modes(fn, inputs, modes, grad_idx)
            with torch.no_grad():
                outs[impl] = fn(*inputs)
        except Exception as exc:
            row[impl] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log(f"      {impl}: {row[impl]}")  # as soon as measured: a run stopped later (a cold autotune) keeps it
    if "ours" in outs and "fla" in outs:
        row["rel_err_ours_vs_fla_o"] = rel(outs["ours"], outs["fla"])
    if "ours-softplus" in outs and "fla-softplus" in outs:
        row["rel_err_ours_vs_fla_o_softplus"] = rel(outs["ours-softplus"], outs["fla-softplus"])
    if "sdpa" in impls:
        try:
            qs, ks, vs = (x.transpose(1, 2).contiguous() for x in inputs[:3])
            row["sdpa"] = time_modes(sdpa_op, (qs, ks, vs), modes, (0, 1, 2))
        except Exception as exc:
            row["sdpa"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return row


def decode_case(batch, impls, H=16, D=128):
    from hybrid_attention.ops.kda.triton_step import fused_recurrent_kda_step

    torch.manual_seed(0)
    q, k, v, z, beta, A_log, dt_bias = op_inputs(batch, 1, H, D)
    state = 0.02 * torch.randn(batch, H, D, D, device="cuda")
    moved = 2 * state.numel() * 4  # bytes of state read + written per step
    row = dict(batch=batch, H=H, D=D, state_bytes_moved=moved)
    gate = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    if "ours" in impls:
        s = state.clone()
        ms = bench(lambda: fused_recurrent_kda_step(q, k, v, z, beta, s, use_qk_l2norm=True, **gate))
        row["ours"] = dict(us=ms * 1e3, GBps=moved / (ms * 1e-3) / 1e9)
    if "fla" in impls:
        from fla.ops.kda import fused_recurrent_kda

        flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, **gate)
        ms = bench(lambda: fused_recurrent_kda(q, k, v, z, beta, initial_state=state, output_final_state=True, **flags))
        row["fla"] = dict(us=ms * 1e3, GBps=moved / (ms * 1e-3) / 1e9)
    return row


def make_layer(impl: str, hidden: int, H: int, D: int) -> torch.nn.Module:
    """Ours (backend="triton") or FLA's KimiDeltaAttention (its fastest path, as our configuration), bf16 on CUDA."""
    if impl == "ours":
        from hybrid_attention.layers.kda import KimiDeltaAttention

        layer = KimiDeltaAttention(hidden, H, head_dim=D, backend="triton")
    elif impl == "fla":
        from fla.layers import KimiDeltaAttention as FlaKDA

        layer = FlaKDA(hidden_size=hidden, num_heads=H, head_dim=D, safe_gate=True, lower_bound=-5)
    else:
        raise ValueError(f"layer implementations are ours and fla, got {impl!r}")
    return layer.to("cuda", torch.bfloat16)


def layer_output(layer, x):
    """The layer's output tensor (FLA's layer returns a tuple)."""
    y = layer(x)
    return y[0] if isinstance(y, tuple) else y


def layer_case(impls, modes, B=8, T=4096, hidden=2048, H=16, D=128):
    torch.manual_seed(0)
    x = torch.randn(B, T, hidden, device="cuda", dtype=torch.bfloat16)
    row = dict(B=B, T=T, hidden=hidden, H=H, D=D)
    for impl in [i for i in ("ours", "fla") if i in impls]:
        try:
            layer = make_layer(impl, hidden, H, D)
            modes_here = [m for m in modes if m != "fwd-train"]
            row[impl] = time_modes(lambda x, layer=layer: layer_output(layer, x), (x,), modes_here, (0,),
                                   params=list(layer.parameters()))  # fmt: skip
            del layer
        except Exception as exc:
            row[impl] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return row


def fmt(x) -> str:
    return f"{x:9.3f}" if isinstance(x, float) and math.isfinite(x) else f"{'-':>9}"


def print_tables(result) -> None:
    print("\n## KDA chunk op (ms, median; ratio = FLA / ours, > 1 means ours is faster)")
    print(f"{'shape':<22} {'mode':<10} {'ours':>9} {'FLA':>9} {'SDPA':>9} {'FLA/ours':>9}")
    for row in result["op"]:
        for mode in ("fwd", "fwd-train", "fwd+bwd"):
            t = {i: row.get(i, {}).get(mode) for i in ("ours", "fla", "sdpa")}
            if all(v is None for v in t.values()):
                continue
            ratio = t["fla"] / t["ours"] if t["ours"] and t["fla"] else None
            print(f"{str(row['shape']):<22} {mode:<10} {fmt(t['ours'])} {fmt(t['fla'])} {fmt(t['sdpa'])} {fmt(ratio)}")
            sp = {i: row.get(i, {}).get(mode) for i in ("ours-softplus", "fla-softplus")}
            if sp["ours-softplus"] or sp["fla-softplus"]:
                ratio = sp["fla-softplus"] / sp["ours-softplus"] if all(sp.values()) else None
                label = f"{mode} softplus"
                print(f"{'':<22} {label:<10} {fmt(sp['ours-softplus'])} {fmt(sp['fla-softplus'])} {'':>9} {fmt(ratio)}")
        if "rel_err_ours_vs_fla_o" in row:
            print(f"{'':<22} rel err of o, ours vs FLA: {row['rel_err_ours_vs_fla_o']:.2e}")
    print("\n## Decode step, H=16, D=128, fp32 state (us per call; GB/s of state read + written)")
    print(f"{'batch':<8} {'ours us':>9} {'ours GB/s':>10} {'FLA us':>9} {'FLA GB/s':>10}")
    for row in result["decode"]:
        o, f = row.get("ours", {}), row.get("fla", {})
        print(
            f"{row['batch']:<8} {fmt(o.get('us'))} {fmt(o.get('GBps')):>10} {fmt(f.get('us'))} {fmt(f.get('GBps')):>10}"
        )
    print("\n## KimiDeltaAttention layer, hidden 2048, 16 x 128, B=8, T=4096 (ms)")
    for row in result["layer"]:
        for mode in ("fwd", "fwd+bwd"):
            o, f = row.get("ours", {}).get(mode), row.get("fla", {}).get(mode)
            ratio = f / o if o and f else None
            print(f"{mode:<10} ours {fmt(o)}  FLA {fmt(f)}  FLA/ours {fmt(ratio)}")
        for impl in ("ours", "fla"):
            if "error" in row.get(impl, {}):
                print(f"  {impl} error: {row[impl]['error']}")
    for key in ("failures", "skipped"):
        if result[key]:
            print(f"\n## {key}")
            for line in result[key]:
                print(" -", line)


def check_thresholds(result) -> None:
    t = result["thresholds"]
    standard = next((r for r in result["op"] if r["shape"] == [8, 4096, 16, 128]), None)
    if standard and isinstance(standard.get("ours"), dict):
        for mode in ("fwd", "fwd+bwd"):
            ours, fla = standard["ours"].get(mode), standard.get("fla", {}).get(mode)
            if ours:
                t[f"8x4096x16x128 {mode} ms"] = ours
            if ours and fla:
                t[f"8x4096x16x128 {mode} FLA/ours (>= 1 is parity)"] = fla / ours
    for row in result["op"]:
        for ours_key, fla_key in (("ours", "fla"), ("ours-softplus", "fla-softplus")):
            for mode in ("fwd", "fwd+bwd"):
                ours, fla = row.get(ours_key, {}).get(mode), row.get(fla_key, {}).get(mode)
                if ours and fla:
                    t[f"{ours_key} {row['shape']} {mode}: FLA / ours = {fla / ours:.3f} (>= 1 is parity)"] = (
                        fla / ours >= 1.0
                    )
    big = next((r for r in result["decode"] if r["batch"] == 256 and "ours" in r), None)
    if big:
        t["decode B=256 >= 3.5 TB/s"] = big["ours"]["GBps"] >= 3500
    print("\n## Thresholds")
    for k, v in t.items():
        print(f" - {k}: {v}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="standard shape only, modes fwd and fwd+bwd, decode, layer")
    p.add_argument("--parts", default="op,decode,layer", help="comma list of op, decode, layer")
    p.add_argument(
        "--impls", default="ours,fla,sdpa", help="comma list of ours, fla, sdpa, ours-softplus, fla-softplus"
    )
    p.add_argument("--shapes", default=None, help="indices into the op shapes, e.g. 0,4 (default: all; --quick: 0)")
    p.add_argument("--budget", type=float, default=540.0, help="start no new case after this many seconds")
    p.add_argument("--out", default=None, help="also write the JSON here (rewritten after every case)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda.py needs a CUDA GPU")
    parts, impls = args.parts.split(","), args.impls.split(",")
    shapes = [int(i) for i in args.shapes.split(",")] if args.shapes else ([0] if args.quick else range(len(OP_SHAPES)))
    modes = ["fwd", "fwd+bwd"] if args.quick else ["fwd", "fwd-train", "fwd+bwd"]
    if "fla" in impls:
        try:
            import fla.ops.kda  # noqa: F401
        except Exception as exc:
            log(f"FLA unavailable ({exc!r}): timing ours and SDPA only")
            impls.remove("fla")
    run = Run(args, sys.argv if argv is None else ["benchmarks/bench_kda.py", *argv])
    if "op" in parts:
        for i in shapes:
            run.case("op", str(OP_SHAPES[i]), lambda i=i: op_case(OP_SHAPES[i], impls, modes))
    if "decode" in parts:
        for batch in DECODE_BATCHES:
            run.case("decode", f"batch {batch}", lambda b=batch: decode_case(b, impls))
    if "layer" in parts:
        run.case("layer", "B8 T4096 hidden 2048", lambda: layer_case(impls, modes))
    run.result["elapsed_s"] = time.time() - run.t0
    print_tables(run.result)
    check_thresholds(run.result)
    run.save()
    print(json.dumps(run.result))


if __name__ == "__main__":
    main()
