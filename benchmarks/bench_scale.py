"""The pretraining-size thresholds in one run: k3-1b against Llama (SDPA) and FLA's KDA model, its AttnRes overhead,
--fp8's speed and loss, and k3-3b at a micro-batch of 4 x 2048 on one card.

    python benchmarks/bench_scale.py                 # both parts (--part speed, then --part loss)
    python benchmarks/bench_scale.py --part speed    # bench_train.py's cases at 4 x 2048, each in its best mode
    python benchmarks/bench_scale.py --part loss     # k3-1b trained --steps times in bf16 and with --fp8, same data
    python benchmarks/bench_scale.py --quick         # CPU, tiny widths: a smoke check of the script
    python benchmarks/bench_scale.py --part speed --cases ours-1b@graph,fla-1b@graph   # some speed cases

The speed part runs `bench_train.py` (its step, MFU and peak memory) on ours-1b and ours-1b-standard replayed from a
CUDA graph, Llama eager and compiled, FLA's model from a CUDA graph, ours-1b bf16 and --fp8 compiled, and ours-3b
with its mixers recomputed (`--activation-checkpointing mixer`). The loss part runs `train` twice, the same seed and
data (the built-in corpus, byte tokens), eagerly, and compares the final validation loss. A table of the thresholds
with each measured figure, then the JSON line (both parts' rows as they came).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import bench_train  # noqa: E402
from benchmarks.bench_common import emit_json, env_info, log  # noqa: E402
from hybrid_attention.arg_types import positive_int  # noqa: E402

SPEED_CASES = (
    "ours-1b@graph",
    "ours-1b-standard@graph",
    "llama-1b@eager",
    "llama-1b@compile",
    "fla-1b@graph",
    "ours-1b@compile",
    "ours-1b:fp8@compile",
    "ours-3b:ckpt-mixer@graph",
)
# --quick: the same comparisons, eagerly (no graphs or compiling on the CPU; FP8 emulated); FLA needs CUDA.
QUICK_CASES = ("ours-1b", "ours-1b-standard", "llama-1b", "ours-1b:fp8", "ours-3b:ckpt-mixer")


def speed_cases(chosen: str | None, quick: bool) -> list[str]:
    """The speed part's cases: all of them, or the comma-separated `chosen` (ValueError naming one that is not)."""
    known = QUICK_CASES if quick else SPEED_CASES
    if not chosen:
        return list(known)
    cases = [c.strip() for c in chosen.split(",") if c.strip()]
    unknown = [c for c in cases if c not in known]
    if unknown or not cases:
        raise ValueError(f"--cases: {', '.join(unknown) or 'none given'}; expected some of {', '.join(known)}")
    return cases


def speed(args) -> list[dict]:
    cases = ",".join(speed_cases(args.cases, args.quick))
    argv = [
        "--cases",
        cases,
        "--modes",
        "eager",
        "--shapes",
        args.shape,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--grad-accum",
        str(args.grad_accum),
    ]
    if args.profile:
        argv += ["--profile", "--profile-top", "25"]
    return bench_train.main(argv + (["--quick"] if args.quick else []))["results"]


def loss(args) -> list[dict]:
    """The final validation loss of `train` in bf16 and with --fp8 (refused off an FP8 GPU: its row says why)."""
    from hybrid_attention.training.config import TrainConfig
    from hybrid_attention.training.loop import train

    preset, batch, seq_len = ("tiny", 4, 64) if args.quick else ("k3-1b", 4, 2048)
    rows = []
    for fp8 in (None, "tensorwise"):
        with tempfile.TemporaryDirectory() as out:
            config = TrainConfig.create(
                preset=preset,
                steps=args.loss_steps,
                batch_size=batch,
                grad_accum=1,
                seq_len=seq_len,
                data="builtin",
                eval_every=args.loss_steps,
                eval_batches=4,
                seed=0,
                fp8=fp8,
                out=out,
            )
            row = dict(run=f"{preset}, --fp8 {fp8}" if fp8 else f"{preset}, bf16", steps=args.loss_steps)
            log(f"train {row['run']} ...")
            try:
                summary = train(config, echo=log)
                row.update(val_loss=summary["val_loss"], tokens_per_s=summary["tokens_per_s"], error=None)
            except ValueError as exc:
                row.update(val_loss=None, tokens_per_s=None, error=str(exc))
            rows.append(row)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def _row(results: list[dict], case: str) -> dict | None:
    """The row of `case` (NAME[:VARIANTS]@MODE) that ran; a --quick row (NAME alone, eager) stands for any mode."""
    names = (case, case.partition("@")[0])
    return next((r for r in results if r["case"] in names and not r["error"]), None)


def thresholds(speed_rows: list[dict], loss_rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(measure, threshold, measured, met) for what the rows measured; "-" where a row is missing or failed."""
    out = []

    def add(measure: str, threshold: str, measured: str | None, met: bool | None) -> None:
        out.append((measure, threshold, measured or "-", "-" if met is None else ("yes" if met else "no")))

    def ratio(a: dict | None, b: dict | None) -> float | None:
        return a["tokens_per_s"] / b["tokens_per_s"] if a and b else None

    if speed_rows:
        ours = _row(speed_rows, "ours-1b@graph")
        mfu = ours.get("mfu") if ours else None
        add("k3-1b MFU, bf16", ">= 40%", mfu and f"{mfu:.1%}", None if mfu is None else mfu >= 0.40)
        llama = [r for r in (_row(speed_rows, "llama-1b@eager"), _row(speed_rows, "llama-1b@compile")) if r]
        best_llama = max(llama, key=lambda r: r["tokens_per_s"], default=None)
        for name, peer in (("Llama-SDPA (best mode)", best_llama), ("FLA KDA", _row(speed_rows, "fla-1b@graph"))):
            x = ratio(ours, peer)
            add(f"k3-1b tokens/s over {name}", ">= 1.3x", x and f"{x:.2f}x", None if x is None else x >= 1.3)
            if ours and peer and ours.get("peak_gib") and peer.get("peak_gib"):
                mine, theirs = ours["peak_gib"], peer["peak_gib"]
                add(f"k3-1b peak memory against {name}", "no higher", f"{mine:.1f} vs {theirs:.1f} GiB", mine <= theirs)
        x = ratio(_row(speed_rows, "ours-1b-standard@graph"), ours)
        over = None if x is None else x - 1  # the standard residual's tokens/s over Block AttnRes's
        add("Block AttnRes overhead at k3-1b", "<= 5%", x and f"{over:+.1%}", None if x is None else over <= 0.05)
        x = ratio(_row(speed_rows, "ours-1b:fp8@compile"), _row(speed_rows, "ours-1b@compile"))
        add("--fp8 tokens/s over bf16, compiled", ">= 1.25x", x and f"{x:.2f}x", None if x is None else x >= 1.25)
        big = _row(speed_rows, "ours-3b:ckpt-mixer@graph")
        peak = big.get("peak_gib") if big else None
        fits = None if peak is None else peak * 2**30 <= 80e9
        add("k3-3b at 4 x 2048, --activation-checkpointing mixer", "fits 80 GB", peak and f"{peak:.1f} GiB", fits)
    if loss_rows:
        bf16, fp8 = loss_rows
        x, text = None, None
        if bf16["val_loss"] is not None and fp8["val_loss"] is not None:
            x = fp8["val_loss"] / bf16["val_loss"] - 1
            text = f"{fp8['val_loss']:.4f} vs {bf16['val_loss']:.4f} ({x:+.2%})"
        add(f"--fp8 loss after {bf16['steps']} steps", "within 1% of bf16", text, None if x is None else abs(x) <= 0.01)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("speed", "loss", "all"), default="all")
    p.add_argument(
        "--cases",
        default=None,
        help="the speed part's cases, comma-separated (default: all; a run can go in parts: each row stands alone)",
    )
    p.add_argument("--shape", default=None, help="BxT of the speed part (default 4x2048; --quick: 2x32)")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--profile", action="store_true", help="also profile each speed case: its 25 slowest kernels")
    p.add_argument("--steps", type=int, default=8, help="timed steps per speed case (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--loss-steps", type=int, default=None, help="steps of each loss run (default 300; --quick: 4)")
    p.add_argument("--quick", action="store_true", help="CPU, tiny widths: a smoke check")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    try:
        speed_cases(args.cases, args.quick)
    except ValueError as exc:
        p.error(str(exc))
    args.shape = args.shape or ("2x32" if args.quick else "4x2048")
    args.loss_steps = args.loss_steps or (4 if args.quick else 300)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    speed_rows = speed(args) if args.part in ("speed", "all") else []
    loss_rows = loss(args) if args.part in ("loss", "all") else []
    rows = thresholds(speed_rows, loss_rows)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\n## pretraining-size thresholds on {device}\n")
    print("| measure | threshold | measured | met |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for r in loss_rows:
        if r["error"]:
            print(f"\n{r['run']}: {r['error']}")
    result = dict(env=env_info(sys.argv), thresholds=rows, speed=speed_rows, loss=loss_rows)
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
