"""Language-model ablations of the hybrid's design choices at a fixed token budget, trained by `training.loop`.

Every variant is the base preset (k3-scaled) with HybridConfig overrides, trained with the same data, tokenizer,
schedule and token budget, once per seed:

    hybrid          the base: 3 KDA : 1 Gated MLA, Full AttnRes
    all-mla         every layer Gated MLA                      (the Kimi Linear report's full-attention baseline)
    all-kda         every layer KDA
    all-mla-rope    every layer MLA with RoPE on the shared key part (the position-encoded baseline)
    mla-no-gate     Gated MLA without its output gate          (plain MLA with NoPE)
    block-attnres   Block AttnRes, blocks of 4 sublayers       (the k3-scaled-block preset)
    standard        the standard residual instead of AttnRes
    gdn             Gated DeltaNet (one decay per head) in place of the KDA layers

Groups compare against "hybrid": ratio (all-mla, all-kda), gate (mla-no-gate), residual (block-attnres, standard),
delta (gdn); `--variants extrapolation` names hybrid, all-kda, all-mla and all-mla-rope, the layouts whose loss past
the training length is in question. Each run lives in OUT/VARIANT-seedN (a run directory: `hybrid-attention eval
--ckpt` works on it); a finished run is read back instead of trained again, so an interrupted sweep continues where it
stopped. `--per-position` then evaluates each run with `hybrid-attention eval --per-position` at 4x and 16x its
training length (`--position-factors`), keeping each evaluation's output in RUN/per-position-N.log (its JSON in
RUN/per-position-N.json, read back on a rerun) and drawing OUT/per_position.png.

    python benchmarks/ablations.py                                  # every variant, seed 0, python-env, k3-scaled
    python benchmarks/ablations.py --variants hybrid,mla-no-gate --seeds 0,1 --tokens 20000000
    python benchmarks/ablations.py --variants extrapolation --seeds 0,1 --per-position   # loss against position
    python benchmarks/ablations.py --quick                          # CPU, tiny preset, a few steps: a smoke check

Table of validation loss and bits per byte on stdout (with the difference to the hybrid of the same seed), curves in
OUT/ablations.png, JSON as the last line (also written to OUT/ablations.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_common import checkout_env, log  # noqa: E402


def variants(num_layers: int) -> dict[str, dict]:
    """HybridConfig overrides of each variant over a base preset of `num_layers` layers."""
    return {
        "hybrid": {},
        "all-mla": {"layer_types": ["mla"] * num_layers},
        "all-kda": {"layer_types": ["kda"] * num_layers},
        "all-mla-rope": {"layer_types": ["mla"] * num_layers, "mla_rope": True},
        "mla-no-gate": {"mla_output_gate": False},
        "block-attnres": {"residual": "block_attnres", "attnres_block_size": 4},
        "standard": {"residual": "standard"},
        "gdn": {"kda_gate": "head"},
    }


VARIANTS = tuple(variants(1))
GROUPS = {"extrapolation": ("hybrid", "all-kda", "all-mla", "all-mla-rope")}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    variant_help = f"comma list of {', '.join(VARIANTS)}, or a group: {', '.join(GROUPS)}"
    p.add_argument("--variants", default=",".join(VARIANTS), help=variant_help)
    p.add_argument("--seeds", default="0", help="comma list of seeds (default 0; 0,1 where a gap is small)")
    p.add_argument("--preset", default="k3-scaled", help="base model preset (default k3-scaled)")
    p.add_argument("--tokens", type=int, default=360 * 16 * 2048, help="training tokens per run (default ~11.8M)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (default 8)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default="python-env", help="corpus (default python-env: the installed packages' sources)")
    p.add_argument("--data-max-bytes", type=int, help="text cap (default: train's)")
    p.add_argument("--tokenizer", default="bpe", choices=("byte", "bpe"))
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches per evaluation (default 16)")
    p.add_argument("--eval-every", type=int, help="validate (and save) every N steps (default: a tenth of the run)")
    p.add_argument("--out", default="runs/ablations", help="parent of the run directories (default runs/ablations)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--cuda-graph", action="store_true", help="replay each training step from a CUDA graph (train's "
                   "--cuda-graph: CUDA, AdamW; the same steps, less host time)")  # fmt: skip
    p.add_argument("--per-position", action="store_true", help="evaluate every run's loss against position")
    p.add_argument("--position-factors", default="4,16", help="evaluate at these multiples of --seq-len (default 4,16)")
    p.add_argument("--position-batches", type=int, default=4, help="batches of windows per evaluation (default 4)")
    p.add_argument("--position-batch-size", type=int, help="windows per batch (default: --batch-size)")
    budget_help = "minutes for this sitting: the run in progress saves and stops when they are up, later ones wait"
    p.add_argument("--time-budget", type=float, help=budget_help + " for a rerun of the same command")
    p.add_argument("--quick", action="store_true", help="CPU smoke check: tiny preset, builtin data, a few steps")
    args = p.parse_args(argv)
    args.deadline = None if args.time_budget is None else time.monotonic() + 60 * args.time_budget
    if args.quick:
        args.preset, args.tokens, args.batch_size, args.seq_len, args.grad_accum = "tiny", 3 * 2 * 32, 2, 32, 1
        args.data, args.data_max_bytes, args.tokenizer, args.eval_batches = "builtin", 200_000, "byte", 1
        args.device = "cpu"
    names = [n for v in args.variants.split(",") if v for n in GROUPS.get(v, (v,))]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        p.error(f"--variants: unknown {unknown}; expected a comma list of {', '.join(VARIANTS)}")
    args.variants = names
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds: expected a comma list of integers, got {args.seeds!r}")
    try:
        args.position_factors = [int(f) for f in args.position_factors.split(",")]
    except ValueError:
        p.error(f"--position-factors: expected a comma list of integers, got {args.position_factors!r}")
    if min(args.position_factors) < 1 or args.position_batches < 1:
        p.error("--position-factors and --position-batches: expected integers >= 1")
    args.steps = args.tokens // (args.batch_size * args.seq_len * args.grad_accum)
    if args.steps < 1:
        p.error(f"--tokens {args.tokens} is less than one step of {args.batch_size * args.seq_len * args.grad_accum}")
    return args


def run_variant(args, name: str, seed: int, overrides: dict) -> dict:
    """Train (or read back) one variant at one seed; returns its summary plus the validation curve."""
    from hybrid_attention.runs import checkpoint
    from hybrid_attention.training.config import TrainConfig
    from hybrid_attention.training.loop import train

    out = Path(args.out) / f"{name}-seed{seed}"
    summary_path = out / checkpoint.SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if summary is not None and summary["step"] >= summary["steps"]:
        log(f"{name} seed {seed}: finished earlier in {out}")
    else:
        minutes = minutes_left(args)
        if minutes is not None and minutes <= 0:
            log(f"{name} seed {seed}: no time left in --time-budget; rerun the same command to train it")
            return None
        if checkpoint.holds_run(out):  # stopped by --time-budget, a signal or a kill: continue where it saved
            log(f"{name} seed {seed}: continuing from step {checkpoint.checkpoint_step(out)} in {out}")
            config = TrainConfig.create(checkpoint.load_config(out)["train"], out=str(out), time_limit=minutes)
            summary = train(config, resume=True, echo=log)
            if summary.get("already_complete"):
                summary = json.loads(summary_path.read_text())
        else:
            log(f"{name} seed {seed}: training {args.steps} steps into {out}")
            config = TrainConfig.create(
                preset=args.preset, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                grad_accum=args.grad_accum, lr=args.lr, data=args.data, data_max_bytes=args.data_max_bytes,
                tokenizer=args.tokenizer, seed=seed, out=str(out), eval_batches=args.eval_batches,
                eval_every=args.eval_every, device=args.device, cuda_graph=args.cuda_graph, time_limit=minutes,
            )  # fmt: skip
            summary = train(config, model_overrides=overrides, echo=log)
        if summary["step"] < summary["steps"]:
            log(f"{name} seed {seed}: stopped at step {summary['step']} of {summary['steps']}; rerun to continue")
            return None
    rows = checkpoint.read_log(out)
    curve = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    return {"variant": name, "seed": seed, "overrides": overrides, "run_dir": str(out), "curve": curve,
            **{k: summary.get(k) for k in ("val_loss", "val_bpb", "train_loss", "parameters", "step", "steps",
                                           "tokens_per_s", "device")}}  # fmt: skip


def minutes_left(args) -> float | None:
    """What is left of --time-budget, in minutes (None without one)."""
    return None if args.deadline is None else (args.deadline - time.monotonic()) / 60


def evaluate_positions(args, result: dict, seq_len: int) -> dict | None:
    """`hybrid-attention eval --per-position` of one run at windows of `seq_len` tokens, in a process of its own (as
    a user runs it), its output kept in RUN/per-position-N.log; the JSON line, also kept (and read back on a rerun)
    in RUN/per-position-N.json."""
    run = Path(result["run_dir"])
    saved = run / f"per-position-{seq_len}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    minutes = minutes_left(args)
    if minutes is not None and minutes <= 0:
        log(f"{run}: no time left in --time-budget for its loss against position; rerun the same command")
        return None
    log(f"{result['variant']} seed {result['seed']}: loss against position in windows of {seq_len:,} tokens")
    windows = [
        "--batch-size",
        str(args.position_batch_size or args.batch_size),
        "--max-batches",
        str(args.position_batches),
    ]
    argv = [sys.executable, "-m", "hybrid_attention", "eval", "--ckpt", str(run), "--seq-len", str(seq_len)]
    argv += ["--per-position", *windows, "--device", args.device, "--plot", str(run / f"per-position-{seq_len}.png")]
    env = checkout_env()
    with open(run / f"per-position-{seq_len}.log", "w") as out:
        out.write(" ".join(argv) + "\n")
        out.flush()
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=out, text=True, env=env)
        out.write(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"the evaluation failed (exit {done.returncode}); see {out.name}")
    line = done.stdout.strip().splitlines()[-1]
    saved.write_text(line + "\n")
    return json.loads(line)


def position_table(results: list[dict], seq_len: int, train_seq_len: int) -> None:
    """The loss per bucket from half the training length on, at windows of `seq_len`, one row per run; the change
    from the last bucket inside the training length to the last one of the window."""
    first = results[0]["per_position"][seq_len]["buckets"]
    shown = [b for b in first if b["stop"] > train_seq_len // 2]
    heads = [f"{b['start']:,}-{b['stop'] - 1:,}" for b in shown]
    print(f"\nloss (nats per token) against position, windows of {seq_len:,} tokens, trained at {train_seq_len:,}:\n")
    print("| variant | seed | " + " | ".join(heads) + " | last - inside |")
    print("|---|---|" + "---|" * (len(heads) + 1))
    for r in results:
        buckets = r["per_position"][seq_len]["buckets"][-len(shown) :]
        inside = [b for b in buckets if b["past_training"] == "no"][-1]["loss"]
        cells = " | ".join(f"{b['loss']:.4f}" for b in buckets)
        print(f"| {r['variant']} | {r['seed']} | {cells} | {buckets[-1]['loss'] - inside:+.4f} |")


def plot_positions(results: list[dict], factors: list[int], train_seq_len: int, path: Path) -> None:
    """One panel per window length: the loss against position of every run (a colour per variant, a line style per
    seed), the training length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybrid_attention.inference.position_report import draw, finish_axes

    fig, axes = plt.subplots(1, len(factors), figsize=(6 * len(factors), 4.5), squeeze=False)
    names = sorted({r["variant"] for r in results}, key=VARIANTS.index)
    for ax, factor in zip(axes[0], factors, strict=True):
        for r in results:
            style = dict(color=f"C{names.index(r['variant'])}", ls=("-", "--", ":", "-.")[r["seed"] % 4])
            label = f"{r['variant']} (seed {r['seed']})"
            draw(ax, r["per_position"][factor * train_seq_len]["buckets"], label, **style)
        finish_axes(ax, train_seq_len, f"windows of {factor * train_seq_len:,} tokens ({factor}x the training length)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r["curve"]:
            ax.plot([t for t, _ in r["curve"]], [v for _, v in r["curve"]], "o-", ms=3,
                    label=f"{r['variant']} (seed {r['seed']})")  # fmt: skip
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from hybrid_attention.config import HybridConfig

    num_layers = HybridConfig.from_preset(args.preset).num_layers
    table = variants(num_layers)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runs = [run_variant(args, name, seed, table[name]) for seed in args.seeds for name in args.variants]
    results = [r for r in runs if r is not None]
    if len(results) < len(runs):
        log(f"{len(runs) - len(results)} of {len(runs)} runs are not finished; rerun the same command to continue")
    base = {r["seed"]: r for r in results if r["variant"] == "hybrid"}
    print(f"\nfixed budget: {args.steps} steps x {args.batch_size * args.seq_len * args.grad_accum} tokens, "
          f"preset {args.preset} with overrides, data {args.data}, tokenizer {args.tokenizer}\n")  # fmt: skip
    print("| variant | seed | parameters | val loss | bits/byte | vs hybrid |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ref = base.get(r["seed"])
        delta = f"{r['val_loss'] - ref['val_loss']:+.4f}" if ref and r is not ref and r["val_loss"] else ""
        print(f"| {r['variant']} | {r['seed']} | {r['parameters']:,} | {r['val_loss']:.4f} | {r['val_bpb']:.4f} | "
              f"{delta} |")  # fmt: skip
    if results:
        plot(results, Path(args.out) / "ablations.png")
    if args.per_position:
        for r in results:
            lengths = [f * args.seq_len for f in args.position_factors]
            r["per_position"] = {n: evaluate_positions(args, r, n) for n in lengths}
        evaluated = [r for r in results if None not in r["per_position"].values()]
        if evaluated:
            for factor in args.position_factors:
                position_table(evaluated, factor * args.seq_len, args.seq_len)
            plot_positions(evaluated, args.position_factors, args.seq_len, Path(args.out) / "per_position.png")
    result = {"preset": args.preset, "steps": args.steps, "tokens_per_run": args.steps * args.batch_size *
              args.seq_len * args.grad_accum, "data": args.data, "tokenizer": args.tokenizer, "results": results,
              "plot": str(Path(args.out) / "ablations.png"), "command": "python " + " ".join(sys.argv)}  # fmt: skip
    line = json.dumps(result)
    (Path(args.out) / "ablations.json").write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
