"""Training step side by side: our presets, transformers' Llama (SDPA) and FLA's KDA model at the same sizes.

Per case and shape: step time (median over --steps after --warmup steps), tokens/s, peak memory of the timed steps
(torch.cuda.max_memory_allocated, optimizer states included; in the graph modes from the capture on, since the
graph allocates its memory once, there) and MFU (`metrics.flops_per_token`: 6 x non-embedding
parameters plus the sequence mixing, against the GPU's dense bf16 peak). Every model keeps float32 parameters and runs
under bf16 autocast (the cases named in --bf16-params instead hold bf16 parameters, no autocast), with fused AdamW
(or, with --optimizer muon, `train`'s Muon for the hidden matrices and fused AdamW for the rest); random tokens.
Every case's step is the one `train` runs, `train_step.TrainStep` (forward, backward, gradient clipping at --clip,
optimizer step), in one of four modes: eager, compile (torch.compile of the model), graph (the whole step
replayed from a CUDA graph) and compile+graph. Each case runs in its own try block: a failure (a missing preset, an
absent library, out of memory, a step that cannot be captured) is listed in the table and the next case runs.

    python benchmarks/bench_train.py                                   # every case, both shapes, eager and compiled
    python benchmarks/bench_train.py --cases ours-full,llama-sdpa --shapes 8x2048 --modes eager --steps 5
    python benchmarks/bench_train.py --cases ours-full,llama-sdpa --shapes 8x2048 --modes eager,graph
    python benchmarks/bench_train.py --cases ours-full --shapes 8x2048 --modes eager,graph --optimizer muon
    python benchmarks/bench_train.py --quick                           # CPU, tiny sizes, seconds: a smoke check
    python benchmarks/bench_train.py --cases ours-full,ours-full-docs,ours-standard,ours-standard-docs \
        --shapes 8x2048 --modes eager --doc-len 1024             # the cost of --doc-mask (packed documents)

The pretraining sizes: ours-1b, ours-1b-full, ours-1b-standard, llama-1b, fla-1b and the same for 3b (k3-1b, k3-3b;
the peers at the preset's hidden size, depth, heads, FFN and vocabulary, `train_cases.py`). A case name takes variants
and its own mode, `NAME[:fp8|:fp8-rowwise][:ckpt-mixer|mlp|all][@MODE]`: FP8 projections (`train --fp8`, torchao),
activation checkpointing (`train --activation-checkpointing`), and a mode that replaces --modes for that case:

    python benchmarks/bench_train.py --shapes 4x2048 --steps 8 --warmup 3 \
        --cases ours-1b@graph,ours-1b-standard@graph,llama-1b@eager,fla-1b@graph,ours-1b:fp8@compile

The "-docs" cases are `train --doc-mask`: the batch packed into one row cut at every row start and at document starts
drawn at random (a mean document of --doc-len tokens, the same cuts every step), each document its own sequence.

Two more columns say whether a step is bound by the host or the GPU: "host ms", the median time until a step's
last launch returns (the host's share; the step ms adds the wait for the GPU), and with --profile "kernel ms", the
summed durations of the kernels of one more step under torch.profiler (the GPU's share).

The JSON also gives each case's `tables_per_step`: the pointer tables the AttnRes kernels built per timed step
(`ops.attnres.rows.tables_built`), 0 when every step's activations land at the addresses of the step before (a
table built is a host tensor and a copy to the GPU, host time an eager step pays).

Markdown table on stdout, JSON as the last line (also written to --out).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_common import emit_json, env_info, log  # noqa: E402
from benchmarks.train_cases import QUICK_SIZES, Case, Spec, make_cases, parse_spec  # noqa: E402
from hybrid_attention.arg_types import positive_int  # noqa: E402
from hybrid_attention.ops.attnres.rows import tables_built  # noqa: E402
from hybrid_attention.training.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from hybrid_attention.training.metrics import peak_flops  # noqa: E402
from hybrid_attention.training.optim import build_optimizers  # noqa: E402
from hybrid_attention.training.step import TrainStep  # noqa: E402

MODES = ("eager", "compile", "graph", "compile+graph")


# ---------------------------------------------------------------------------------------------------------- running
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return peak_flops(name)


def run_case(
    case: Case, batch: int, seq_len: int, mode: str, args, device: torch.device, spec: Spec | None = None
) -> dict:
    """One case at one shape and mode: warm-up steps (the capture in the graph modes), then `args.steps` timed
    steps. `spec`: the FP8 and activation checkpointing variants asked for."""
    torch.manual_seed(0)
    model, loss_fn, flops = case.build()
    bf16_params = case.name in args.bf16_params
    model = model.to(device, dtype=torch.bfloat16 if bf16_params else None).train()
    if spec is not None and spec.fp8:
        from hybrid_attention.training.fp8 import convert_to_fp8

        # On the CPU (--quick) torchao emulates the FP8 products in higher precision.
        convert_to_fp8(model, spec.fp8, emulate=device.type != "cuda")
    if spec is not None and spec.checkpointing != "none":  # our models only (`parse_spec`)
        apply_activation_checkpointing(model, spec.checkpointing)
    if args.optimizer == "muon":
        optimizers = build_optimizers(model, optimizer="muon", lr=1e-4, weight_decay=0.1)
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")]
    # dynamic=False: one graph per shape, not a dynamic-shape graph after the second shape.
    runner = torch.compile(model, dynamic=False) if mode.startswith("compile") else model
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.grad_accum, batch, seq_len), device=device)  # [grad_accum, B, T]
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=not bf16_params)  # noqa: E731
    graph = mode.endswith("graph")
    train_step = TrainStep(
        lambda x: loss_fn(runner, x),
        model.parameters(),
        optimizers,
        grad_accum=args.grad_accum,
        clip=args.clip or None,
        autocast=autocast,
        cuda_graph=graph,
    )

    def step() -> torch.Tensor:
        return train_step.step(ids)[0]  # the loss (a static buffer under a graph)

    if graph and device.type == "cuda":  # the graph's memory is allocated once, at its capture in the first step
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(max(args.warmup, int(graph))):  # the first graph step captures: never timed
        step()
    _sync(device)
    if device.type == "cuda" and not graph:  # eager: the steady steps only, not the autotuning of the first
        torch.cuda.reset_peak_memory_stats(device)
    times, host = [], []
    built = tables_built()
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        host.append(time.perf_counter() - start)  # until the last launch returns: the host's share
        _sync(device)
        times.append(time.perf_counter() - start)
    loss = float(loss)  # before another step overwrites a graph's output
    tables_per_step = (tables_built() - built) / max(args.steps, 1)
    step_s = statistics.median(times)
    kernel_ms, top_kernels = _kernel_profile(step, device, args.profile_top) if args.profile else (None, None)
    tokens_per_s = args.grad_accum * batch * seq_len / step_s  # every micro-batch of the optimizer step
    fpt = flops(seq_len)
    peak = _peak_flops(device)
    return dict(
        precision="bf16 params" if bf16_params else "fp32 params, bf16 autocast",
        grad_accum=args.grad_accum,
        step_ms=step_s * 1e3,
        host_ms=statistics.median(host) * 1e3,
        kernel_ms=kernel_ms,
        top_kernels=top_kernels,
        tokens_per_s=tokens_per_s,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        flops_per_token=fpt,
        mfu=fpt * tokens_per_s / peak if peak else None,
        loss=loss,
        parameters=sum(p.numel() for p in model.parameters()),
        tables_per_step=tables_per_step,
    )


def _kernel_profile(step: Callable, device: torch.device, top: int) -> tuple[float | None, list | None]:
    """The summed durations of the kernels one step runs (torch.profiler): its GPU time without the gaps where the
    GPU waits for the host; and the `top` kernels by summed time as [name, ms, launches]. (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    ranked = [[e.key[:90], e.self_device_time_total / 1e3, e.count] for e in kernels[:top]]
    return sum(e.self_device_time_total for e in kernels) / 1e3, ranked


def _variant_words(spec: Spec) -> list[str]:
    """The variants of a case as its description's tail."""
    words = [f", --fp8 {spec.fp8}"] if spec.fp8 else []
    return words + ([f", --activation-checkpointing {spec.checkpointing}"] if spec.checkpointing != "none" else [])


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    columns = ["case", "model", "B x T", "mode", "precision", "step ms", "host ms", "kernel ms", "tokens/s", "peak GiB"]
    columns += ["MFU", "status"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        status = "ok" if r["error"] is None else f"failed: {r['error']}"
        shape = f"{r['batch']} x {r['seq_len']}"
        if r.get("grad_accum", 1) > 1:
            shape = f"{r['grad_accum']} x {shape}"
        print(
            f"| {r['case']} | {r['description']} | {shape} | {r['mode']} | "
            f"{r.get('precision', '-')} | "
            f"{_fmt(r.get('step_ms'), '.1f')} | {_fmt(r.get('host_ms'), '.1f')} | {_fmt(r.get('kernel_ms'), '.1f')} | "
            f"{_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(r.get('peak_gib'), '.1f')} | {_fmt(r.get('mfu'), '.1%')} | {status} |"
        )


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            b, t = item.lower().split("x")
            shapes.append((int(b), int(t)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes: expected BxT[,BxT...] such as 8x2048, got {item!r}") from None
    return shapes


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="all", help="comma-separated case names, or 'all'")
    p.add_argument("--shapes", type=parse_shapes, default=None, help="BxT list (default 8x2048,1x16384)")
    p.add_argument(
        "--modes", default=None, help=f"comma-separated, of {', '.join(MODES)} (default eager,compile; --quick: eager)"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per case (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        help="micro-batches of BxT per optimizer step, as train --grad-accum (tokens/s and MFU count them all)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip as in train (default 1.0; 0: none)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="adamw, or muon for the hidden matrices and adamw for the rest, as in train",
    )
    p.add_argument("--bf16-params", default="", help="comma-separated cases to run with bf16 parameters, no autocast")
    p.add_argument("--quick", action="store_true", help="CPU, tiny widths, 2 x 32 tokens, 2 steps: a smoke check")
    p.add_argument(
        "--profile", action="store_true", help="also run one step under torch.profiler: the kernels' summed time"
    )
    p.add_argument("--profile-top", type=int, default=0, help="with --profile: list each case's N slowest kernels")
    p.add_argument("--doc-len", type=int, default=1024, help="mean document length of the -docs cases (tokens)")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)

    if args.quick:
        device, sizes = torch.device("cpu"), QUICK_SIZES
        shapes = args.shapes or [(2, 32)]
        args.modes = args.modes or "eager"  # inductor's CPU compile alone takes minutes
        given = " ".join(sys.argv if argv is None else argv)
        args.steps = args.steps if "--steps" in given else 2
        args.warmup = args.warmup if "--warmup" in given else 1
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA device (or --quick for the CPU smoke check)")
        device, sizes = torch.device("cuda"), {}
        shapes = args.shapes or [(8, 2048), (1, 16384)]
    cases = make_cases(sizes, args.doc_len)
    texts = list(cases) if args.cases == "all" else [n.strip() for n in args.cases.split(",")]
    try:
        specs = [parse_spec(text, cases, MODES) for text in texts]
    except ValueError as e:
        p.error(f"--cases: {e}")
    args.bf16_params = {n.strip() for n in args.bf16_params.split(",") if n.strip()}
    unknown = sorted(args.bf16_params - set(cases))
    if unknown:
        p.error(f"--bf16-params: unknown {unknown}; expected some of {list(cases)}")
    modes = [m.strip() for m in (args.modes or "eager,compile").split(",")]
    if any(m not in MODES for m in modes):
        p.error(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}")

    runs = [(spec, mode) for mode in modes for spec in specs if spec.mode is None]
    runs += [(spec, spec.mode) for spec in specs if spec.mode is not None]  # a case@MODE runs in its mode alone
    rows = []
    for batch, seq_len in shapes:
        for spec, mode in runs:
            case = cases[spec.name]
            description = case.description + "".join(_variant_words(spec))
            row = dict(case=spec.text, description=description, batch=batch, seq_len=seq_len, mode=mode)
            log(f"{spec.text} {batch}x{seq_len} {mode} ...")
            try:
                row.update(run_case(case, batch, seq_len, mode, args, device, spec), error=None)
            except Exception as exc:  # listed in the table; the next case runs
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                log(traceback.format_exc(limit=3))
                del exc
            _free(device)
            log(f"  {row}")
            rows.append(row)

    optimizer = "fused AdamW" if device.type == "cuda" else "AdamW"
    if args.optimizer == "muon":
        optimizer = f"Muon (hidden matrices) + {optimizer}"
    clip = f"clip {args.clip:g}" if args.clip else "no clip"
    accum = f", {args.grad_accum} micro-batches per optimizer step" if args.grad_accum > 1 else ""
    print(
        f"## training step, {optimizer}, {clip}{accum}, random tokens, median of {args.steps} steps after "
        f"{args.warmup}\n"
    )
    print_table(rows)
    rebuilt = [r for r in rows if r.get("tables_per_step")]
    if rebuilt:  # eager steps whose activations moved: each table is host work in every step
        print(
            "\nPointer tables built per timed step: "
            + ", ".join(
                f"{r['case']} {r['batch']} x {r['seq_len']} {r['mode']} {r['tables_per_step']:g}" for r in rebuilt
            )
        )
    for r in rows:
        if r.get("top_kernels"):
            print(f"\n### {r['case']}, {r['batch']} x {r['seq_len']}, {r['mode']}: slowest kernels of one step\n")
            print("| kernel | ms | launches |\n|---|---|---|")
            print("\n".join(f"| `{name}` | {ms:.2f} | {n} |" for name, ms, n in r["top_kernels"]))
    env = env_info(sys.argv) if device.type == "cuda" else dict(device="cpu", torch=torch.__version__)
    result = dict(env=env, optimizer=optimizer, clip=args.clip, steps=args.steps, warmup=args.warmup, results=rows)
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
