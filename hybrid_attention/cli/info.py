"""`hybrid-attention info`: a preset's or a run's parameters, layer table, cache sizes, training FLOPs per token and
the memory a training step needs on a card (training/memory_report.py)."""

from __future__ import annotations

import argparse

from hybrid_attention.arg_types import number, positive_float, positive_int
from hybrid_attention.choices import CARDS, OPTIMIZERS
from hybrid_attention.cli.common import plural
from hybrid_attention.config import PRESETS  # torch-free: --help and bad flags answer before torch loads


def add_arguments(i: argparse.ArgumentParser) -> None:
    """The flags of `info` on its subparser `i`."""
    src = i.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, help="a model preset (default tiny)")
    src.add_argument("--ckpt", help="run directory written by `train`")
    i.add_argument("--vocab-size", type=positive_int, help="vocabulary size for --preset (default: the preset's)")
    i.add_argument("--model-config", metavar="FILE", help="a JSON object of model settings over the preset's")
    i.add_argument("--batch-size", type=positive_int, help="sequences per micro-batch (default: the run's or train's)")
    i.add_argument("--seq-len", type=number(int, 2), help="tokens per sequence (default: the run's or train's)")
    i.add_argument("--grad-accum", type=positive_int, help="micro-batches per step (default: the run's or train's)")
    i.add_argument("--optimizer", choices=OPTIMIZERS, help="whose state to count (default: the run's, or adamw)")
    card = i.add_mutually_exclusive_group()
    card.add_argument("--card", choices=CARDS, help="say whether a step fits this card (default: this machine's GPU)")
    card.add_argument("--device-memory", type=positive_float, metavar="GIB", help="...or a card of this many GiB")
    i.set_defaults(func=run)


def run(args) -> int:
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model_size import model_size
    from hybrid_attention.training.config import TrainConfig

    if args.ckpt:
        from hybrid_attention.runs.checkpoint import run_model_config
        from hybrid_attention.runs.run_config import load_config

        if args.model_config:
            raise ValueError("--model-config applies to --preset; a run's model is the one in its config.json")
        saved = load_config(args.ckpt)  # read and checked once: the model and the training settings
        c, source = run_model_config(args.ckpt, saved), args.ckpt
        run = TrainConfig.create(saved["train"], out=str(args.ckpt))
    else:
        preset = args.preset or "tiny"
        overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        if args.model_config:
            from hybrid_attention.runs.run_config import read_model_config

            overrides = {**read_model_config(args.model_config, preset), **overrides}
        c = HybridConfig.from_preset(preset, **overrides)
        source = f"preset {preset}" + (f" with {args.model_config}" if args.model_config else "")
        run = TrainConfig.create(preset=preset)  # train's defaults for the preset
    size = model_size(c)  # from one layer of each type: any depth answers at once
    _print_sizes(source, c, size)
    _print_training(args, c, size, run)
    return 0


def _print_sizes(source: str, c, size) -> None:
    """Parameters in all and per layer, and the inference cache per token and per sequence."""
    in_layers = sum(row["parameters"] for row in size.layers)
    layers = plural(c.num_layers, "layer")
    print(f"{source}: hidden {c.hidden_size}, {layers}, vocabulary {c.vocab_size}, residual {c.residual}")
    print(
        f"parameters: {size.parameters:,} total; {size.embedding:,} embedding; {in_layers:,} in decoder layers; "
        f"{size.parameters - size.embedding - in_layers:,} in the head, final norm and final AttnRes"
    )
    print(f"{'layer':>5}  {'type':<4}  {'parameters':>12}")
    for row in size.layers:
        print(f"{row['index']:>5}  {row['type']:<4}  {row['parameters']:>12,}")
    per_token, state = size.cache_bytes_per_token, size.state_bytes_per_sequence
    num_mla = sum(t == "mla" for t in c.layer_types)
    mla_layers = plural(num_mla, "MLA layer")
    print(f"cache per token of context: {per_token:,} bytes (bf16 MLA latent rows [c ; k_s], {mla_layers})")
    print(
        f"constant state per sequence: {state:,} bytes (fp32 KDA state + bf16 conv tails, "
        f"{plural(c.num_layers - num_mla, 'KDA layer')})"
    )
    for context in (4096, 131072):
        print(f"  at {context:,} tokens: {(per_token * context + state) / 2**20:,.1f} MiB per sequence")


def _print_training(args, c, size, run) -> None:
    """FLOPs per token and the memory of a training step on the card --card or --device-memory names, else on this
    machine's GPU when it has one."""
    from hybrid_attention.training.memory import CARD_MEMORY, CARD_NAMES
    from hybrid_attention.training.memory_report import training_lines

    card_bytes, card_name = None, None
    if args.card:
        card_bytes, card_name = CARD_MEMORY[args.card], f"an {CARD_NAMES[args.card]}"
    elif args.device_memory:
        card_bytes, card_name = args.device_memory * 2**30, "the card"
    else:
        import torch

        if torch.cuda.is_available():
            card_bytes, card_name = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    lines = training_lines(
        c,
        size,
        batch_size=args.batch_size or run.batch_size,
        seq_len=args.seq_len or run.seq_len,
        grad_accum=args.grad_accum or run.grad_accum,
        optimizer=args.optimizer or run.optimizer,
        card_bytes=card_bytes,
        card_name=card_name,
    )
    print("\n".join(lines))
