"""`hybrid-attention train`: its flags, and the run it starts or resumes."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from hybrid_attention.arg_types import non_negative_float, non_negative_int, positive_float, positive_int, seed_int
from hybrid_attention.choices import (
    ACTIVATION_CHECKPOINTING,
    DEVICES,
    DTYPES,
    FP8_RECIPES,
    OPTIMIZERS,
    REPORTERS,
    TOKENIZERS,
)
from hybrid_attention.cli.common import add_backend_flags, data_spec, plural, say_when_compiling
from hybrid_attention.config import PRESETS  # torch-free: --help and bad flags answer before torch loads


def add_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("--preset", choices=PRESETS, help="model size (default tiny)")
    t.add_argument(
        "--model-config",
        metavar="FILE",
        help="a JSON object of model settings (HybridConfig fields) over the preset's, saved with the run",
    )
    t.add_argument("--steps", type=positive_int, help="optimizer steps (tiny: 250, larger presets: 300)")
    t.add_argument("--batch-size", type=positive_int, help="sequences per micro-batch, all ranks together (default 8)")
    t.add_argument("--seq-len", type=positive_int, help="tokens per sequence (tiny: 128, larger: 2048)")
    t.add_argument("--grad-accum", type=positive_int, help="micro-batches per optimizer step (tiny: 1, larger: 2)")
    t.add_argument("--lr", type=positive_float, help="peak learning rate (tiny: 3e-3, larger: 1e-3)")
    t.add_argument("--warmup", type=non_negative_int, help="linear warm-up steps before the cosine decay")
    t.add_argument("--optimizer", choices=OPTIMIZERS, help="adamw (default), or muon for 2-D hidden weights")
    t.add_argument("--weight-decay", type=non_negative_float, help="decoupled weight decay on matrices (default 0.1)")
    t.add_argument("--clip", type=non_negative_float, help="gradient norm clip, 0 = off (default 1.0)")
    t.add_argument(
        "--data",
        type=data_spec,
        help="a folder of shards from `tokenize` (streamed), or read now: a file, a folder of .txt/.md/.py, "
        "hf:NAME[:CONFIG], builtin (the standard library; tiny's default) or python-env (every installed package's "
        "Python sources; the larger presets' default)",
    )
    t.add_argument("--data-max-bytes", type=positive_int, help="text cap (builtin, hf: 4e6; python-env: 2.56e8)")
    t.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        help="byte (default) or a BPE trained on the train split; shards bring their own",
    )
    t.add_argument(
        "--doc-mask",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every document as its own sequence: no state or attention across a document's end, no "
        "loss on predicting the next one's first token (off by default: README, Data)",
    )
    t.add_argument("--vocab-size", type=positive_int, help="BPE vocabulary size (default 8192)")
    t.add_argument("--seed", type=seed_int, help="seed of the initialisation and the batches (default 0)")
    t.add_argument("--out", help="run directory (default runs/PRESET)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    t.add_argument(
        "--extend-steps",
        type=positive_int,
        help="with --resume: train N steps past the run's --steps (finished or not), the learning rate rising again "
        "to --lr and decaying by a cosine over the new steps",
    )
    t.add_argument("--stop-after", type=positive_int, help="save and stop after this step (the schedule keeps --steps)")
    t.add_argument("--time-limit", type=positive_float, help="save and stop after this many minutes of training")
    t.add_argument("--eval-every", type=positive_int, help="validate, plot, checkpoint every N steps (default: 10%%)")
    t.add_argument("--eval-batches", type=positive_int, help="batches per split per evaluation (tiny: 4, else 8)")
    t.add_argument("--log-every", type=positive_int, help="append to log.jsonl every N steps (default 10)")
    t.add_argument("--device", choices=DEVICES, help="default: cuda when available")
    t.add_argument("--dtype", choices=DTYPES, help="autocast dtype (auto: bf16 on CUDA)")
    t.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    t.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="capture the whole training step in a CUDA graph and replay it (less host time per step; CUDA "
        "only, one process; may change on --resume)",
    )
    add_backend_flags(t, default=None)
    t.add_argument(
        "--fsdp-reshard-after-forward",
        action="store_true",
        default=None,
        help="torchrun: free gathered "
        "layer weights after the forward, gather them again for the backward (less memory)",
    )
    t.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="all",
        choices=ACTIVATION_CHECKPOINTING,
        help="recompute the mixers, the MLPs or all of both in the backward instead of keeping their activations (less "
        "memory; alone: all)",
    )
    t.add_argument(
        "--fp8",
        nargs="?",
        const="tensorwise",
        choices=FP8_RECIPES,
        help="the large projections in FP8 through torchao's float8 training, with tensorwise (alone) or rowwise "
        "scaling (an Ada or Hopper GPU; fast with --compile)",
    )
    t.add_argument("--dist-timeout", type=positive_float, help="torchrun: seconds a rank waits for the others (600)")
    t.add_argument(
        "--report-to",
        nargs="+",
        choices=REPORTERS,
        metavar="{tensorboard,wandb}",
        help="also send the curves there (RUN/tensorboard; wandb when installed); log.jsonl stays",
    )
    t.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import fields

    from hybrid_attention.runs import checkpoint
    from hybrid_attention.training.config import TrainConfig
    from hybrid_attention.training.loop import train

    given = {f.name: getattr(args, f.name, None) for f in fields(TrainConfig)}
    saved = None
    if args.resume and args.model_config:
        raise ValueError("--model-config sets a new run's model; a resumed run keeps the one in its config.json")
    if args.resume:
        out = args.out or f"runs/{args.preset or 'tiny'}"
        saved = checkpoint.load_config(out)["train"]
        given["out"] = out
    config = TrainConfig.create(saved, extend_steps=args.extend_steps, **given)
    overrides = None
    if args.model_config:
        from hybrid_attention.runs.run_config import read_model_config

        overrides = read_model_config(args.model_config, config.preset)
    from hybrid_attention.device import resolve_device

    say_when_compiling(resolve_device(config.device))
    start = time.perf_counter()
    resume_command = f"hybrid-attention train --resume --out {shlex.quote(config.out)}"
    try:
        s = train(config, resume=args.resume, model_overrides=overrides)
    except KeyboardInterrupt:
        try:
            step = checkpoint.checkpoint_step(config.out)
            kept = f"its checkpoint of step {step}" if step else "no checkpoint yet"
        except (ValueError, OSError):
            kept = "its last complete checkpoint"
        print(f"\naborted: {config.out} keeps {kept}; continue with `{resume_command}`", file=sys.stderr)
        return 130
    if s.get("already_complete"):
        return 0
    if s["stopped_by"]:
        print(
            f"{s['stopped_by']}: saved a checkpoint of step {s['step']} of {s['steps']} in {config.out}; "
            f"continue with `{resume_command}`",
            file=sys.stderr,
        )
        from hybrid_attention.training.interrupts import exit_code

        return exit_code(s["stopped_by"])
    minutes, seconds = divmod(time.perf_counter() - start, 60)
    print(f"done: step {s['step']}/{s['steps']} in {int(minutes)}m{seconds:04.1f}s, {s['tokens_per_s']:,.0f} tokens/s")
    if s["step"] < s["steps"]:
        print(f"stopped early; continue with `{resume_command}`")
    if s["val_loss"] is not None:
        print(
            f"validation loss {s['val_loss']:.4f} nats/token ({s['val_bpb']:.3f} bits/byte) on "
            f"{plural(s['val_windows'], 'window')} of {s['seq_len']} tokens, "
            f"{s['val_loss'] - s['train_eval_loss']:+.4f} from the training windows; "
            f"unigram baseline {s['unigram_loss']:.4f} nats/token ({s['unigram_bpb']:.3f} bits/byte)"
        )
    if s["memory"] is not None:
        from hybrid_attention.training.report import memory_line

        mfu = "unknown (the device is not in the peak-FLOPs table)" if s["mfu"] is None else f"{s['mfu']:.1%}"
        print(f"{memory_line(s['device'], s['memory'])}; model FLOPs utilisation {mfu} of the datasheet bf16 peak")
    print(f"run directory: {config.out}; sample with `hybrid-attention generate --ckpt {config.out} --prompt 'def '`")
    return 0
