"""The `hybrid-attention synth` command (also `python -m hybrid_attention.synth`): flags, then a grid of runs, a
table of the best accuracy per task, length and model, the plot, and a JSON summary as the last line."""

from __future__ import annotations

import argparse
import json

from hybrid_attention.arg_types import non_negative_float, positive_float, positive_int, seed_int
from hybrid_attention.choices import DEVICES, DTYPES, KDA_BACKENDS, OPTIMIZERS, RESIDUALS

# The lengths that separate the models (512, 1024) first, then the short and the long end.
DEFAULT_GRID = "palindrome,mqar,stack/512,1024/kda,gdn,mla;palindrome,mqar,stack/256,2048/kda,gdn,mla"
DEFAULT_LRS = "5e-4,1e-3,3e-3"


def _lrs(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated learning rates, got {text!r}") from None
    if not values or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected learning rates in (0, 1), got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grid",
        default=DEFAULT_GRID,
        help="cells TASKS/LENGTHS/MODELS[/STEPS] separated by ';' "
        "(tasks: palindrome, mqar, stack; models: kda, gdn, mla; default: all three tasks and models at "
        "512 and 1024, then at 256 and 2048)",
    )
    p.add_argument("--steps", type=positive_int, default=2000, help="steps of a cell that names none (default 2000)")
    p.add_argument("--lrs", type=_lrs, default=_lrs(DEFAULT_LRS), help=f"learning rates swept (default {DEFAULT_LRS})")
    p.add_argument("--batch-size", type=positive_int, default=64, help="sequences per step (default 64)")
    p.add_argument("--num-symbols", type=positive_int, default=64, help="alphabet of the random content (default 64)")
    p.add_argument("--mqar-queries", type=positive_int, help="keys queried per MQAR sequence (default: half the pairs)")
    p.add_argument(
        "--mqar-pairs",
        type=positive_int,
        help="key-value pairs per MQAR sequence, the same at every "
        "length (default: a quarter of the sequence, length // 8 pairs)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the data and the initialisation")
    p.add_argument("--eval-every", type=positive_int, help="evaluate every N steps (default: 20 points per run)")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="fixed evaluation batches (default 4)")
    p.add_argument("--time-budget", type=positive_float, help="minutes: skip the runs that would not fit any more")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default 2)")
    p.add_argument("--heads", type=positive_int, default=2, help="heads per mixer (default 2)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="channels per head (default 128)")
    p.add_argument("--residual", choices=RESIDUALS, default="standard")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw, or muon for the hidden matrices and adamw for the rest (default adamw)",
    )
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--out", default="runs/synth", help="directory of log.jsonl and accuracy.png (default runs/synth)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on CUDA")
    p.add_argument("--kda-backend", choices=KDA_BACKENDS, default="auto")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each training step from a CUDA graph (CUDA only): the same steps, faster for models this small",
    )


def run(args) -> int:
    from hybrid_attention.device import resolve_device
    from hybrid_attention.machine import check_fits
    from hybrid_attention.synth.plots import plot_accuracy
    from hybrid_attention.synth.run import Settings, best_by_lr, grid_runs, read_rows, run_grid

    runs = grid_runs(args.grid, args.lrs, steps=args.steps)
    settings = Settings(
        batch_size=args.batch_size,
        num_symbols=args.num_symbols,
        mqar_queries=args.mqar_queries,
        mqar_pairs=args.mqar_pairs,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=args.head_dim,
        residual=args.residual,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        kda_backend=args.kda_backend,
    )
    for length in sorted({spec.seq_len for spec in runs if spec.task == "mqar"}):
        settings.task("mqar", length)  # a bad --mqar-queries or --mqar-pairs fails before any run
    device = resolve_device(args.device)
    if args.cuda_graph and device.type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device, got {device}")
    for name, length in sorted({(spec.task, spec.seq_len) for spec in runs}):
        per_token = 16 + 2 * settings.task(name, length).vocab_size  # int64 ids and labels, bf16 logits at least
        what = f"a batch of {args.batch_size:,} {name} sequences of {length:,} tokens (--grid, --batch-size)"
        check_fits(args.batch_size * length * per_token, what, device)
    budget = args.time_budget * 60 if args.time_budget else None
    finals, skipped = run_grid(
        runs, settings, args.out, device=device, dtype=args.dtype, budget_s=budget, cuda_graph=args.cuda_graph
    )
    best = best_by_lr(finals)
    print(f"\n{'task':<10} {'length':>6} {'model':<5} {'best lr':>8} {'steps':>6} {'accuracy':>8} {'ms/step':>8}")
    for (task, seq_len, model), r in sorted(best.items()):
        accuracy = "diverged" if r["diverged"] else f"{r['accuracy']:.3f}"
        print(
            f"{task:<10} {seq_len:>6} {model:<5} {r['lr']:>8g} {r['steps']:>6} {accuracy:>8} "
            f"{r['s_per_step'] * 1e3:>8.1f}"
        )
    plot = plot_accuracy(args.out, read_rows(args.out)) if best else None
    if skipped:
        print(f"skipped by the time budget: {len(skipped)} runs (rerun with the same --out to continue)")
    if plot:
        print(f"plot: {plot}")
    summary = {
        "best": [r for _, r in sorted(best.items())],
        "skipped": [list(s.key()) for s in skipped],
        "log": f"{args.out}/log.jsonl",
        "plot": str(plot) if plot else None,
        "device": str(device),
    }
    print(json.dumps(summary))
    return 0
