"""`hybrid-attention generate`: stream text from a trained run."""

from __future__ import annotations

import argparse
import codecs
import sys
import time

from hybrid_attention.arg_types import non_negative_float, non_negative_int, number, positive_int, seed_int
from hybrid_attention.choices import DEVICES, DTYPES
from hybrid_attention.cli.common import add_backend_flags, backends, device_and_dtype, plural

# The context `generate` allows by default, in multiples of the length the run trained on: far enough to use what
# the recurrent KDA state and the position-free MLA carry past it, short of a prompt that prefills for minutes.
CONTEXT_FACTOR = 16


def add_arguments(g: argparse.ArgumentParser) -> None:
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
    add_backend_flags(g)
    g.set_defaults(func=run)


def run(args) -> int:
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
    device, dtype = device_and_dtype(args)
    warm_start(device, dtype=dtype)  # the first calls' one-time costs, beside the checkpoint's loading
    model, config, tokenizer = load_run(args.ckpt, device, **backends(args))
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
