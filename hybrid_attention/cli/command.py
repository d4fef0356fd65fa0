"""The `hybrid-attention` command: train, generate, eval, info, export, tokenize, serve, synth. Thin: parse flags,
call the package, print. Bad input ends with one line on stderr and a non-zero exit, never a traceback (set
HYBRID_ATTENTION_TRACEBACK=1 to see it anyway)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import warnings

from hybrid_attention.cli import evaluate, export, generate, info, serve, tokenize, train
from hybrid_attention.config import IgnoredSetting  # torch-free: --help and bad flags answer before torch loads


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybrid-attention", description="Train, sample and inspect hybrid KDA + MLA models.")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{train,generate,eval,info,export,tokenize,serve,synth}"
    )
    train.add_arguments(
        sub.add_parser("train", help="train a model (default: the tiny preset on the built-in corpus, CPU-sized)")
    )
    generate.add_arguments(sub.add_parser("generate", help="stream text from a trained run"))
    evaluate.add_arguments(sub.add_parser("eval", help="validation loss and bits per byte of a trained run"))
    info.add_arguments(
        sub.add_parser("info", help="parameters, layer table, cache sizes and training memory of a preset or a run")
    )
    export.add_arguments(
        sub.add_parser(
            "export",
            help="gather a torchrun run's sharded checkpoint into model.safetensors; --hf: "
            "also write a transformers model directory",
        )
    )
    tokenize.add_arguments(
        sub.add_parser(
            "tokenize", help="tokenize a corpus into shards that `train --data DIR` streams (every core, resumable)"
        )
    )
    serve.add_arguments(
        sub.add_parser("serve", help="an OpenAI-compatible completions server with continuous batching")
    )
    from hybrid_attention.synth import cli as synth_cli

    y = sub.add_parser("synth", help="synthetic recall suite: Palindrome, MQAR, Stack with KDA, GDN and MLA models")
    synth_cli.add_arguments(y)
    y.set_defaults(func=synth_cli.run)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A stored setting that no longer applies is one line on stderr; other warnings as Python shows them."""
    if issubclass(category, IgnoredSetting):
        print(f"hybrid-attention: note: {message}", file=sys.stderr)
    else:
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)


_PYTHON_SHOWWARNING = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = _show_warning
    try:
        from hybrid_attention.device import flush_denormals

        with flush_denormals():
            return args.func(args) or 0
    except KeyboardInterrupt:
        print("hybrid-attention: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hybrid-attention generate ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail again
        return 0
    except (ValueError, OSError) as err:
        if os.environ.get("HYBRID_ATTENTION_TRACEBACK"):
            raise
        print(f"hybrid-attention {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as err:
        if not _out_of_memory(err) or os.environ.get("HYBRID_ATTENTION_TRACEBACK"):
            raise
        detail = textwrap.shorten(str(err), 160, placeholder=" ...")  # at a word boundary
        print(
            f"hybrid-attention {args.command}: error: out of memory ({detail}); {_MEMORY_ADVICE[args.command]}",
            file=sys.stderr,
        )
        return 1


_MEMORY_ADVICE = {
    "train": "try a smaller --batch-size or --seq-len (--grad-accum keeps the tokens per step)",
    "generate": "try a smaller --max-new-tokens or a shorter prompt",
    "eval": "try a smaller --batch-size or --seq-len",
    "info": "",
    "export": "",
    "serve": "try a smaller --max-batched-tokens or --cache-memory-fraction",
    "tokenize": "try a smaller --shard-tokens or fewer --workers",
    "synth": "try a smaller --batch-size or shorter lengths in --grid",
}


def _out_of_memory(err: BaseException) -> bool:
    """A failed allocation: MemoryError, torch.OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError."""
    text = str(err)
    return isinstance(err, MemoryError) or any(
        s in text for s in ("out of memory", "can't allocate memory", "not enough memory")
    )
