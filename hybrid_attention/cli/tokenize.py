"""`hybrid-attention tokenize`: a corpus into shards that `train --data DIR` streams."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from hybrid_attention.arg_types import positive_int
from hybrid_attention.choices import TOKENIZERS
from hybrid_attention.cli.common import data_spec


def add_arguments(k: argparse.ArgumentParser) -> None:
    k.add_argument(
        "--data",
        required=True,
        type=data_spec,
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
    k.set_defaults(func=run)


def run(args) -> int:
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
