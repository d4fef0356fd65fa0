"""The `hybrid-attention` command: train, generate, eval, info, export, tokenize, serve, synth. Thin: parse flags,
call the package, print.

Bad input (flags, paths, run directories) ends with one line on stderr and a non-zero exit, never a traceback;
set HYBRID_ATTENTION_TRACEBACK=1 to see the traceback anyway.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import shlex
import sys
import textwrap
import time
import warnings
from pathlib import Path

from hybrid_attention.arg_types import (
    non_negative_float,
    non_negative_int,
    number,
    positive_float,
    positive_int,
    seed_int,
)
from hybrid_attention.choices import (
    ACTIVATION_CHECKPOINTING,
    ATTNRES_BACKENDS,
    DEVICES,
    DTYPES,
    FP8_RECIPES,
    KDA_BACKENDS,
    OPTIMIZERS,
    REPORTERS,
    TOKENIZERS,
)
from hybrid_attention.config import (  # torch-free: --help and bad flags answer before torch loads
    PRESETS,
    IgnoredSetting,
)
from hybrid_attention.info_command import add_info_arguments
from hybrid_attention.wording import plural

# The context `generate` allows by default, in multiples of the length the run trained on: far enough to use what
# the recurrent KDA state and the position-free MLA carry past it, short of a prompt that prefills for minutes.
CONTEXT_FACTOR = 16


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _data_spec(text: str) -> str:
    """Local paths are stored absolute, so a resumed run finds its data from any directory."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path or hf:NAME, got an empty string")
    if text.startswith("hf:") or text in ("builtin", "python-env"):
        return text
    path = Path(text).expanduser().resolve()
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise argparse.ArgumentTypeError(f"{text} is neither a regular file nor a directory")
    return str(path)


def _backend_flags(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """Which kernels run: chosen when a model is loaded, never stored with it."""
    parser.add_argument("--kda-backend", choices=KDA_BACKENDS, default=default, help="chunk_kda backend (default auto)")
    parser.add_argument(
        "--attnres-backend",
        choices=ATTNRES_BACKENDS,
        default=default,
        help="AttnRes: auto (fused Triton ops on CUDA), triton, or torch (the reference)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybrid-attention", description="Train, sample and inspect hybrid KDA + MLA models.")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{train,generate,eval,info,export,tokenize,serve,synth}"
    )

    t = sub.add_parser("train", help="train a model (default: the tiny preset on the built-in corpus, CPU-sized)")
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
        type=_data_spec,
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
    _backend_flags(t, default=None)
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
    t.set_defaults(func=_train)

    g = sub.add_parser("generate", help="stream text from a trained run")
    g.add_argument("--ckpt", required=True, help="run directory written by `train`")
    g.add_argument("--prompt", help="prompt text (default: read from stdin)")
    g.add_argument("--max-new-tokens", type=non_negative_int, default=200, help="tokens to generate (default 200)")
    g.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=positive_int, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=number(float, 0.0, inclusive=False, high=1.0), help="nucleus sampling mass")
    g.add_argument("--seed", type=seed_int, default=0, help="sampling seed (default 0)")
    g.add_argument(
        "--max-context",
        type=positive_int,
        help=f"prompt + new tokens at most (default: {CONTEXT_FACTOR} x the --seq-len the run trained on)",
    )
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on CUDA")
    _backend_flags(g)
    g.set_defaults(func=_generate)

    e = sub.add_parser("eval", help="validation loss and bits per byte of a trained run")
    e.add_argument("--ckpt", required=True, help="run directory written by `train`")
    e.add_argument(
        "--data",
        type=_data_spec,
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
    _backend_flags(e)
    e.set_defaults(func=_eval)

    add_info_arguments(
        sub.add_parser("info", help="parameters, layer table, cache sizes and training memory of a preset or a run")
    )

    x = sub.add_parser(
        "export",
        help="gather a torchrun run's sharded checkpoint into model.safetensors; --hf: "
        "also write a transformers model directory",
    )
    x.add_argument("--ckpt", required=True, help="run directory written by `train`")
    x.add_argument("--hf", metavar="OUT_DIR", help="new directory: transformers model + tokenizer")
    x.set_defaults(func=_export)

    k = sub.add_parser(
        "tokenize", help="tokenize a corpus into shards that `train --data DIR` streams (every core, resumable)"
    )
    k.add_argument(
        "--data",
        required=True,
        type=_data_spec,
        help="a folder (of .txt/.md/.py, .jsonl, .json, .parquet files), one such file, a `datasets` folder "
        "from save_to_disk, hf:NAME[:CONFIG] (offline when cached), builtin or python-env",
    )
    k.add_argument("--out", required=True, help="folder of shards (a rerun finishes an interrupted one)")
    k.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), bpe (trained on the first 32 MB of training documents), a run directory or a "
        "tokenizer.json (byte-level BPE); an end-of-document token is added where it has none",
    )
    k.add_argument("--vocab-size", type=positive_int, help="BPE vocabulary size (default 8192)")
    k.add_argument("--text-field", default="text", help="the text of a JSON, Parquet or dataset record (default text)")
    k.add_argument("--shard-tokens", type=positive_int, help="tokens per shard, about (default 16,777,216)")
    k.add_argument("--workers", type=positive_int, help="processes (default: every core)")
    k.add_argument("--strict", action="store_true", help="refuse files that are not UTF-8 and records without text")
    k.set_defaults(func=_tokenize)

    v = sub.add_parser("serve", help="an OpenAI-compatible completions server with continuous batching")
    source = v.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="run directory written by `train`, or a folder written by `export --hf`")
    source.add_argument(
        "--preset",
        choices=PRESETS,
        help="random weights of a preset with the byte vocabulary, to measure the server (its text is noise)",
    )
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=number(int, 0, high=65535), default=8000, help="default 8000; 0: any free port")
    v.add_argument("--device", choices=DEVICES, default="auto")
    v.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on CUDA")
    v.add_argument("--model-name", help="the model id clients send (default: the run directory's name)")
    v.add_argument("--max-running", type=positive_int, default=64, help="sequences decoding at once (default 64)")
    v.add_argument(
        "--max-context",
        type=positive_int,
        default=8192,
        help="prompt + completion tokens of one request (default 8192)",
    )
    v.add_argument(
        "--max-queue", type=non_negative_int, default=256, help="requests waiting for cache; more get 429 (default 256)"
    )
    v.add_argument(
        "--max-batched-tokens",
        type=positive_int,
        default=2048,
        help="tokens per engine iteration: a decode token per running sequence, the rest prefill (2048)",
    )
    v.add_argument("--max-prefilling", type=positive_int, default=4, help="prompts in prefill at once (default 4)")
    v.add_argument("--page-size", type=positive_int, default=64, help="tokens per latent cache page (default 64)")
    v.add_argument(
        "--cache-memory-fraction",
        type=number(float, 0.0, inclusive=False, high=1.0),
        default=0.9,
        help="CUDA: share of the GPU's memory the server fills, weights included (default 0.9)",
    )
    v.add_argument(
        "--num-pages",
        type=positive_int,
        help="latent cache pages (default: from the memory fraction "
        "on CUDA, enough for --max-running full contexts on the CPU)",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM (default 30)",
    )
    v.add_argument(
        "--stream-interval",
        type=non_negative_float,
        default=0.0,
        help="least seconds between two chunks of a stream (default 0: send tokens as they come)",
    )
    v.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (slower; for debugging)")
    _backend_flags(v)
    v.set_defaults(func=_serve)

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


def _train(args) -> int:
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

    _say_when_compiling(resolve_device(config.device))
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


def _tokenize(args) -> int:
    from hybrid_attention.data.tokenize_corpus import DEFAULT_SHARD_TOKENS, Settings, describe, tokenize

    tokenizer, run_tokenizer = args.tokenizer, None
    if tokenizer not in TOKENIZERS:
        tokenizer = str(Path(tokenizer).expanduser().resolve())  # a run directory or a file, from any directory
        if Path(tokenizer).is_dir():
            from hybrid_attention.data.tokenizer import tokenizer_from_dict
            from hybrid_attention.runs.run_config import load_config

            run_tokenizer = tokenizer_from_dict(load_config(tokenizer)["tokenizer"], tokenizer)
    settings = Settings(
        data=args.data,
        tokenizer=tokenizer,
        vocab_size=args.vocab_size,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        strict=args.strict,
    )
    start = time.perf_counter()
    index = tokenize(settings, args.out, run_tokenizer=run_tokenizer, workers=args.workers)
    print(f"{args.out}: {describe(index)}; {time.perf_counter() - start:.1f} s")
    print(f"train on it with `hybrid-attention train --data {shlex.quote(str(args.out))}`")
    return 0


def _device_and_dtype(args):
    from hybrid_attention.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    _say_when_compiling(device)
    return device, resolve_dtype(device, args.dtype)


def _say_when_compiling(device) -> None:
    """On CUDA, a line on stderr whenever a Triton kernel compiles (the first run on a machine) instead of silence."""
    if device.type != "cuda":
        return
    from tqdm import tqdm

    from hybrid_attention.ops.triton_support import triton_available

    if triton_available():
        from hybrid_attention.ops.triton_cache import announce_compilation

        announce_compilation(lambda line: tqdm.write(line, file=sys.stderr))


def _backends(args) -> dict:
    return {"kda_backend": args.kda_backend, "attnres_backend": args.attnres_backend}


def _generate(args) -> int:
    import torch

    from hybrid_attention.inference.generate import generate_stream
    from hybrid_attention.ops.warm_start import warm_start
    from hybrid_attention.runs.checkpoint import load_run
    from hybrid_attention.training.config import TrainConfig

    if sys.stdout is None:  # started with stdout closed (`>&-`): there is nowhere to write the text
        raise ValueError("stdout is closed, and generate writes the text there; redirect it (> FILE) instead")
    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("no prompt: pass --prompt TEXT or pipe text on stdin")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the prompt on stdin is not UTF-8 (byte {data[e.start]:#04x} at {e.start})") from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # undecodable bytes in argv arrive as lone surrogates
        raise ValueError(f"--prompt is not UTF-8 text (a byte that is not UTF-8 at character {e.start})") from None
    if not prompt:
        raise ValueError("the prompt is empty; generation needs at least one token to start from")
    device, dtype = _device_and_dtype(args)
    warm_start(device, dtype=dtype)  # the first calls' one-time costs, beside the checkpoint's loading
    model, config, tokenizer = load_run(args.ckpt, device, **_backends(args))
    model.to(dtype)
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
    max_new_tokens = _within_context(args, ids.shape[1], TrainConfig.create(config["train"], out=str(args.ckpt)))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(prompt)
    sys.stdout.flush()
    start = time.perf_counter()
    first = None
    count = 0
    # A prefill that takes more than a few seconds shows its progress on stderr (inference/prefill.py).
    for token in generate_stream(model, ids, max_new_tokens, args.temperature, args.top_k, args.top_p, None, generator):
        count += 1
        if first is None:
            first = time.perf_counter()
        sys.stdout.write(decoder.decode(tokenizer.token_bytes(int(token[0]))))
        sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    sys.stdout.flush()
    end = time.perf_counter()
    if not count:
        print("[no tokens generated: --max-new-tokens 0]", file=sys.stderr)
        return 0
    total = ids.shape[1] + count
    timing = f"{plural(count, 'token')} in {end - start:.2f} s: prefill of {ids.shape[1]} tokens + first token "
    timing += f"{first - start:.3f} s" + (f", then {(count - 1) / (end - first):,.1f} tokens/s" if count > 1 else "")
    print(
        f"[{timing}; cache {model.make_cache(1, total).nbytes():,} bytes for {total} tokens "
        f"({model.cache_bytes_per_token(dtype):,} bytes/token of MLA latent + "
        f"{model.state_bytes_per_sequence(dtype):,} bytes of KDA state, {str(dtype).replace('torch.', '')})]",
        file=sys.stderr,
    )
    return 0


def _within_context(args, prompt_tokens: int, run) -> int:
    """--max-new-tokens bounded by the context limit (a line on stderr when it is); a prompt beyond it is refused."""
    limit = args.max_context or CONTEXT_FACTOR * run.seq_len
    why = "--max-context" if args.max_context else f"{CONTEXT_FACTOR} x the run's --seq-len {run.seq_len}"
    if prompt_tokens > limit:
        raise ValueError(
            f"the prompt is {prompt_tokens:,} tokens, more than the context limit of {limit:,} ({why}); shorten it, "
            "or pass a larger --max-context"
        )
    room = limit - prompt_tokens
    if args.max_new_tokens > room:
        print(
            f"hybrid-attention generate: note: --max-new-tokens {args.max_new_tokens:,} reaches past the context "
            f"limit of {limit:,} tokens ({why}); generating at most {room:,} after the {prompt_tokens:,}-token prompt",
            file=sys.stderr,
        )
    return min(args.max_new_tokens, room)


def _eval(args) -> int:
    from hybrid_attention.data.loader import check_eval_windows
    from hybrid_attention.data.training_data import open_training_data
    from hybrid_attention.device import autocast_for
    from hybrid_attention.machine import check_fits
    from hybrid_attention.runs.checkpoint import load_run
    from hybrid_attention.training.config import TrainConfig
    from hybrid_attention.training.metrics import evaluate
    from hybrid_attention.training.packed_rows import PackedRows

    plot = _check_per_position_flags(args)
    device, _ = _device_and_dtype(args)
    model, config, tokenizer = load_run(args.ckpt, device, **_backends(args))
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
    from hybrid_attention.device import resolve_dtype
    from hybrid_attention.inference.position_loss import position_buckets, position_losses
    from hybrid_attention.inference.position_report import device_name, report

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


def _serve(args) -> int:
    try:
        from hybrid_attention.inference.server import run_server
    except ImportError as e:
        raise ValueError(
            f"serve needs FastAPI, uvicorn and prometheus_client ({e.name} is missing): "
            "pip install 'hybrid-attention[serve]'"
        ) from None
    from hybrid_attention.inference.engine import Engine
    from hybrid_attention.inference.engine_config import EngineConfig
    from hybrid_attention.inference.model_source import load_for_serving
    from hybrid_attention.ops.warm_start import warm_start

    config = EngineConfig(
        max_running=args.max_running,
        max_context=args.max_context,
        max_queue=args.max_queue,
        max_batched_tokens=args.max_batched_tokens,
        max_prefilling=args.max_prefilling,
        page_size=args.page_size,
        num_pages=args.num_pages,
        cache_memory_fraction=args.cache_memory_fraction,
        cuda_graphs=False if args.no_cuda_graphs else None,
    )
    device, dtype = _device_and_dtype(args)
    warm_start(device, dtype=dtype)
    model, tokenizer, name = load_for_serving(
        ckpt=args.ckpt, preset=args.preset, device=device, dtype=dtype, **_backends(args)
    )
    engine = Engine(model, tokenizer, config)
    engine.warm_up()
    name = args.model_name or name
    cache_gib = engine.cache.nbytes() / 2**30

    def ready(host: str, port: int) -> None:
        print(
            f"hybrid-attention serve: ready at http://{host}:{port}/v1, model {name!r} on {device} "
            f"({str(dtype).replace('torch.', '')}): {engine.num_pages} cache pages of {config.page_size} tokens "
            f"({cache_gib:.2f} GiB with the state slots), up to {config.max_running} running sequences of "
            f"{config.max_context} tokens",
            file=sys.stderr,
            flush=True,
        )

    run_server(
        engine,
        host=args.host,
        port=args.port,
        model_name=name,
        shutdown_timeout=args.shutdown_timeout,
        on_ready=ready,
        stream_interval=args.stream_interval,
    )
    return 0


def _export(args) -> int:
    from hybrid_attention.runs import checkpoint, dist_checkpoint

    if dist_checkpoint.needs_export(args.ckpt):  # a torchrun run's DCP shards, gathered
        print(f"wrote {dist_checkpoint.export(args.ckpt)}; `generate`, `eval` and `info` read it on one device")
    elif args.hf is None:
        directory = checkpoint.latest_checkpoint(args.ckpt)
        if directory is None:
            raise checkpoint.no_checkpoint_error(args.ckpt)
        print(
            f"{directory / checkpoint.WEIGHTS} is already one file, which `generate`, `eval` and `info` read: "
            "nothing to gather (pass --hf OUT_DIR for a transformers model directory)"
        )
    if args.hf is None:
        return 0
    try:
        from hybrid_attention.hf.export import export_run
    except ImportError:
        raise ValueError("--hf needs the optional transformers package: pip install 'hybrid-attention[hf]'") from None

    out = export_run(args.ckpt, args.hf)
    print(
        f"wrote {out}; load with `import hybrid_attention.hf` and AutoModelForCausalLM.from_pretrained({str(out)!r}), "
        "or without the package with trust_remote_code=True"
    )
    return 0
