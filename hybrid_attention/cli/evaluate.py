"""`hybrid-attention eval`: a run's validation loss and bits per byte, or its loss against position."""

from __future__ import annotations

import argparse
import math
import sys

from hybrid_attention.arg_types import number, positive_int
from hybrid_attention.choices import DEVICES, DTYPES
from hybrid_attention.cli.common import add_backend_flags, backends, data_spec, device_and_dtype, plural


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--ckpt", required=True, help="run directory written by `train`")
    e.add_argument(
        "--data",
        type=data_spec,
        help="evaluate on this data's validation split (default: the run's; a folder of shards included)",
    )
    e.add_argument("--data-max-bytes", type=positive_int, help="read at most this much text")
    e.add_argument("--batch-size", type=positive_int, help="default: the run's")
    e.add_argument("--seq-len", type=number(int, 2), help="default: the run's (at least 2: one prediction)")
    e.add_argument(
        "--max-batches",
        type=positive_int,
        help="batches of windows evenly spaced over the split (default: the run's --eval-batches, so the windows its "
        "training validated on)",
    )
    e.add_argument(
        "--per-position",
        action="store_true",
        help="the loss in buckets of position in the window, through the cache a chunk at a time (memory-bounded at "
        "any --seq-len): does it hold past the length the run trained on? A table, then a JSON line",
    )
    e.add_argument("--buckets", type=positive_int, help="with --per-position: K equal buckets (default: powers of two)")
    e.add_argument("--plot", help="with --per-position: draw the loss against position into this .png, .pdf or .svg")
    e.add_argument("--device", choices=DEVICES, default="auto")
    e.add_argument("--dtype", choices=DTYPES, default="auto")
    add_backend_flags(e)
    e.set_defaults(func=run)


def run(args) -> int:
    from hybrid_attention.data.loader import check_eval_windows
    from hybrid_attention.data.training_data import open_training_data
    from hybrid_attention.device import autocast_for
    from hybrid_attention.machine import check_fits
    from hybrid_attention.runs.checkpoint import load_run
    from hybrid_attention.training.config import TrainConfig
    from hybrid_attention.training.metrics import evaluate
    from hybrid_attention.training.packed_rows import PackedRows

    plot = _check_per_position_flags(args)
    device, _ = device_and_dtype(args)
    model, config, tokenizer = load_run(args.ckpt, device, **backends(args))
    run = TrainConfig.create(config["train"], out=str(args.ckpt))  # the saved settings, checked
    if args.per_position and run.doc_mask:
        raise ValueError(
            f"--per-position reads each window as one sequence, but {args.ckpt} trained with --doc-mask, where "
            "positions restart at every document"
        )
    if args.data is None:
        data, max_bytes = run.data, args.data_max_bytes or run.data_max_bytes
    else:
        data, max_bytes = args.data, args.data_max_bytes
    source = open_training_data(data, max_bytes=max_bytes, tokenizer=tokenizer, splits=("val",))
    tokens = source.val
    batch_size, seq_len = args.batch_size or run.batch_size, args.seq_len or run.seq_len
    if tokens.numel() < seq_len:
        raise ValueError(f"the validation split of {source.source} has {tokens.numel()} tokens, fewer than {seq_len}")
    num_batches = args.max_batches or run.eval_batches  # the windows training validates on, by default
    check_eval_windows(tokens.numel(), batch_size, seq_len, num_batches, "validation", "--max-batches")
    flags = f"--batch-size {batch_size:,} x --seq-len {seq_len:,}"
    check_fits(8 * batch_size * seq_len, f"a batch's {batch_size * seq_len:,} token ids ({flags})", device)
    autocast = autocast_for(device, args.dtype)
    if args.per_position:
        return _eval_per_position(args, model, tokenizer, source, run, seq_len, batch_size, num_batches, plot)
    loss, bpb = evaluate(
        PackedRows(model),
        tokens,
        tokenizer.byte_lengths().to(device),
        batch_size=batch_size,
        seq_len=seq_len,
        num_batches=num_batches,
        autocast=autocast,
        documents=run.doc_mask,
    )
    windows = f"{plural(num_batches * batch_size, 'window')} of {seq_len} tokens"
    if not math.isfinite(loss):  # finite weights can still overflow; checksums and the load check the rest
        raise ValueError(f"{args.ckpt}: the validation loss on {windows} is {loss}; the weights are unusable")
    print(
        f"{args.ckpt} on {source.source} (validation split: {windows} evenly spaced over its {tokens.numel():,}"
        f"{', every document its own sequence' if run.doc_mask else ''}): loss {loss:.4f} nats/token, "
        f"{bpb:.4f} bits/byte"
    )
    return 0


def _check_per_position_flags(args):
    """--buckets and --plot belong to --per-position; the checked --plot path."""
    from hybrid_attention.inference.position_report import check_plot_path

    for flag, value in (("--buckets", args.buckets), ("--plot", args.plot)):
        if value is not None and not args.per_position:
            raise ValueError(f"{flag} needs --per-position")
    return None if args.plot is None else check_plot_path(args.plot)


def _eval_per_position(args, model, tokenizer, source, run, seq_len, batch_size, num_batches, plot) -> int:
    from hybrid_attention.device import device_name, resolve_dtype
    from hybrid_attention.inference.position_loss import position_buckets, position_losses
    from hybrid_attention.inference.position_report import report

    if args.buckets is not None and args.buckets > seq_len - 1:
        raise ValueError(f"--buckets {args.buckets}: a window of {seq_len:,} tokens predicts {seq_len - 1:,} positions")
    device = model.embed.weight.device
    dtype = resolve_dtype(device, args.dtype)
    model.to(dtype)  # as `generate` runs it: the cache and the decode kernels in one dtype (bf16 on CUDA by default)
    print(
        f"{args.ckpt} on {source.source}: the loss against position in {plural(num_batches * batch_size, 'window')} "
        f"of {seq_len:,} tokens ({seq_len / run.seq_len:g} x the --seq-len {run.seq_len:,} it trained at)",
        file=sys.stderr,
    )
    result = position_losses(
        model,
        source.val,
        tokenizer.byte_lengths(),
        seq_len=seq_len,
        batch_size=batch_size,
        num_batches=num_batches,
        buckets=position_buckets(seq_len, args.buckets),
    )
    precision = str(dtype).removeprefix("torch.")
    context = dict(ckpt=str(args.ckpt), data=source.source, device=device_name(device), dtype=precision)
    report(result, train_seq_len=run.seq_len, plot=plot, **context)
    return 0
