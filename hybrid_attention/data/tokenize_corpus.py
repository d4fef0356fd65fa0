"""`hybrid-attention tokenize`: a source into shards (shards.py) on every core, resumable after a kill
(docs/training.md, "Shards").
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hybrid_attention.data.formats import Skipped, plan_units, read_unit, split_of
from hybrid_attention.data.shards import INDEX, SPLITS, file_sha256, read_index, token_dtype, write_index, write_shard
from hybrid_attention.data.token_cache import encode_in_groups, split_section, tokenizer_section, write_corpus_shards
from hybrid_attention.data.tokenizer import (
    BPE_FILE,
    BPE_TRAIN_MAX_BYTES,
    DEFAULT_BPE_VOCAB,
    BPETokenizer,
    ByteTokenizer,
)
from hybrid_attention.files import atomic_write_text

PLAN = "plan.json"
PARTS = "parts"
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 per shard: a kill loses at most a unit per worker
SAMPLE_BYTES = 2_000_000  # text encoded to estimate the bytes per token that size the units
ENCODE_BYTES = 4_000_000  # text per batch-encoding call inside a worker
IN_MEMORY = ("builtin", "python-env")


@dataclass(frozen=True)
class Settings:
    """What decides the shards (the number of workers does not)."""

    data: str
    tokenizer: str = "byte"  # "byte", "bpe", a run directory or a tokenizer.json
    vocab_size: int | None = None
    text_field: str = "text"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    strict: bool = False


def _in_memory(spec: str) -> bool:
    path = Path(spec)
    return spec in IN_MEMORY or (path.is_file() and not path.name.endswith((".jsonl", ".json", ".parquet")))


def tokenize(
    settings: Settings,
    out: str | Path,
    *,
    run_tokenizer=None,
    workers: int | None = None,
    progress: bool = True,
    echo=print,
):
    """Tokenize `settings.data` into the folder `out` (docs/training.md, "Shards"); returns the index.

    When `settings.tokenizer` names a run directory, `run_tokenizer` is that run's tokenizer, read by the caller
    (reading a run belongs to `runs/`, which this data module sits below)."""
    out = Path(out)
    if settings.shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be a positive number of tokens, got {settings.shard_tokens}")
    if (out / INDEX).is_file():
        index = read_index(out)
        if index.get("settings") != asdict(settings):
            raise ValueError(f"--out {out} already holds shards of other settings ({index.get('settings')})")
        echo(f"{out} is complete: nothing to do")
        return index
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if _in_memory(settings.data):
        from hybrid_attention.data.sources import load_corpus

        corpus = load_corpus(None if settings.data == "builtin" else settings.data)
        tokenizer = _resolve_tokenizer(settings, out, sample=corpus.train, run_tokenizer=run_tokenizer)
        return write_corpus_shards(corpus, tokenizer, out, progress=progress, settings=asdict(settings))
    out.mkdir(parents=True, exist_ok=True)
    units, _ = plan_units(settings.data, settings.shard_tokens)  # any unit size reads the documents in one order
    train_bpe = settings.tokenizer == "bpe" and not (out / PLAN).is_file()
    sample = (
        []
        if settings.tokenizer == "byte"
        else _sample(units, settings, BPE_TRAIN_MAX_BYTES if train_bpe else SAMPLE_BYTES)
    )
    tokenizer = _resolve_tokenizer(settings, out, sample=sample, run_tokenizer=run_tokenizer)
    ratio = 1.0 if tokenizer.kind == "byte" else _bytes_per_token(tokenizer, _head(sample, SAMPLE_BYTES))
    units, source = plan_units(settings.data, max(1, round(settings.shard_tokens * ratio)))
    plan = {"settings": asdict(settings), "tokenizer": tokenizer_section(tokenizer)["sha256"], "units": units}
    _check_or_write_plan(out, plan)
    records = _finished(out, len(units))
    pending = [i for i in range(len(units)) if i not in records]
    if records:
        echo(f"{out}: {len(records)} of {len(units)} units already tokenized and checked; {len(pending)} to go")
    records.update(_run(units, pending, settings, out, tokenizer, workers, progress))
    return _write_index(out, settings, tokenizer, source, [records[i] for i in range(len(units))])


# ----------------------------------------------------------------------------------------------------- tokenizer
def _sample(units: list[dict], settings: Settings, max_bytes: int) -> list[str]:
    """The first training documents of the source, until `max_bytes` of text are reached."""
    docs, size, skipped = [], 0, Skipped()
    for unit in units:
        for name, text, split in read_unit(unit, settings.text_field, settings.strict, skipped):
            if split_of(name, split) == "train" and text.strip():
                docs.append(text)
                size += len(text)
                if size >= max_bytes:
                    return docs
    return docs


def _head(docs: list[str], max_bytes: int) -> list[str]:
    """The documents `_sample(..., max_bytes)` would have taken from the same source."""
    size = 0
    for n, doc in enumerate(docs, start=1):
        size += len(doc)
        if size >= max_bytes:
            return docs[:n]
    return docs


def _resolve_tokenizer(settings: Settings, out: Path, *, sample: list[str], run_tokenizer=None):
    """The tokenizer `--tokenizer` names, with an end-of-document token; a BPE is saved in `out` (and read back from
    there on a rerun, so a trained one is trained once)."""
    choice, saved = settings.tokenizer, out / BPE_FILE
    if choice == "byte":
        if settings.vocab_size not in (None, 256):
            raise ValueError(f"--vocab-size {settings.vocab_size} needs --tokenizer bpe (the byte tokenizer has 256)")
        return ByteTokenizer()
    if choice == "bpe" and saved.is_file() and (out / PLAN).is_file():
        return BPETokenizer.load(saved)
    if choice == "bpe":
        if not sample:
            raise ValueError(f"--data {settings.data}: no training document to train a BPE on")
        tokenizer = BPETokenizer.train(sample, settings.vocab_size or DEFAULT_BPE_VOCAB)
    else:
        if settings.vocab_size is not None:
            raise ValueError(f"--vocab-size applies to --tokenizer bpe; {choice} has its own vocabulary")
        path = Path(choice)
        if path.is_dir():
            if run_tokenizer is None:
                raise ValueError(f"--tokenizer {choice} is a run directory: pass its tokenizer as run_tokenizer")
            tokenizer = run_tokenizer
        elif path.is_file():
            tokenizer = BPETokenizer.load(path)
        else:
            raise ValueError(f"--tokenizer {choice}: expected byte, bpe, a run directory or a tokenizer.json file")
        if tokenizer.kind == "byte":
            return ByteTokenizer()  # a run saved before the end-of-document id: the same bytes, with it
        tokenizer = tokenizer.with_eod()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(saved, tokenizer.to_json())
    return tokenizer


def _bytes_per_token(tokenizer, docs: list[str]) -> float:
    ids, _ = tokenizer.encode_packed(docs)
    return max(1.0, sum(len(d.encode("utf-8")) for d in docs) / max(1, ids.size))


# ------------------------------------------------------------------------------------------------- plan and parts
def _check_or_write_plan(out: Path, plan: dict) -> None:
    path = out / PLAN
    if not path.is_file():
        atomic_write_text(path, json.dumps(plan) + "\n")
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e}); remove {out} and start again") from None
    if saved.get("settings") != plan["settings"]:
        raise ValueError(
            f"--out {out} holds an unfinished tokenize of other settings ({saved.get('settings')}); rerun that "
            "command to finish it, or choose another --out"
        )
    if saved.get("tokenizer") != plan["tokenizer"]:
        raise ValueError(f"--out {out} was started with another tokenizer; choose another --out")
    if saved.get("units") != plan["units"]:
        raise ValueError(f"--data {plan['settings']['data']} changed since {out} was started; choose another --out")


def _part(out: Path, i: int) -> Path:
    return out / PARTS / f"{i:05d}.json"


def _finished(out: Path, num_units: int) -> dict[int, dict]:
    """The records of units whose shards are all present and match their SHA-256."""
    records = {}
    for i in range(num_units):
        try:
            record = json.loads(_part(out, i).read_text(encoding="utf-8"))
            entries = [record[s] for s in SPLITS if record[s] is not None]
            if all(file_sha256(out / e["file"]) == e["sha256"] for e in entries):
                records[i] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue  # missing, cut short or damaged: the unit is tokenized again
    return records


# ---------------------------------------------------------------------------------------------------- the workers
_WORKER: dict = {}


def _init_worker(out: str, kind: str, parent: int) -> None:
    if sys.platform.startswith("linux"):  # a killed tokenize must not leave workers writing into its folder
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died while this one started: nothing will ever come to do
            os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER["tokenizer"] = ByteTokenizer() if kind == "byte" else BPETokenizer.load(Path(out) / BPE_FILE)


def _tokenize_unit(i: int, unit: dict, settings: Settings, out: str) -> dict:
    """Tokenize unit `i` into `train-{i}` and `val-{i}` shards; returns its record."""
    tokenizer, out = _WORKER["tokenizer"], Path(out)
    dtype = token_dtype(tokenizer.vocab_size)
    docs: dict[str, list[str]] = {s: [] for s in SPLITS}
    skipped = Skipped()
    for name, text, split in read_unit(unit, settings.text_field, settings.strict, skipped):
        if text.strip():
            docs[split_of(name, split)].append(text)
    record = {"unit": i, "skipped": dict(skipped), "text_bytes": {}}
    for split in SPLITS:
        record["text_bytes"][split] = sum(len(d.encode("utf-8")) for d in docs[split])
        groups = list(encode_in_groups(tokenizer, docs[split], ENCODE_BYTES))
        ids, lengths = [g[0] for g in groups], [g[1] for g in groups]
        path = out / f"{split}-{i:05d}.safetensors"
        record[split] = write_shard(path, np.concatenate(ids), np.concatenate(lengths), dtype) if ids else None
    atomic_write_text(_part(out, i), json.dumps(record) + "\n")
    return record


def _call_unit(args) -> tuple[int, dict]:
    return args[0], _tokenize_unit(*args)


def _run(units, pending, settings: Settings, out: Path, tokenizer, workers, progress) -> dict[int, dict]:
    """Tokenize the `pending` units on `workers` processes (default: every core), with a progress bar over bytes."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    (out / PARTS).mkdir(exist_ok=True)
    workers = max(1, min(workers or os.cpu_count() or 1, len(pending) or 1))
    total = sum(u["size"] for u in units)
    done_bytes = total - sum(units[i]["size"] for i in pending)
    jobs = [(i, units[i], settings, str(out)) for i in pending]
    records = {}
    start = time.perf_counter()
    bar = tqdm(total=total, initial=done_bytes, desc="tokenize", unit="B", unit_scale=True, disable=not progress)

    def finished(i: int, record: dict) -> None:
        records[i] = record
        bar.update(units[i]["size"])
        bar.set_postfix(MB_s=f"{(bar.n - done_bytes) / 1e6 / (time.perf_counter() - start):.1f}", refresh=False)

    try:
        if workers == 1:
            _WORKER["tokenizer"] = tokenizer
            for job in jobs:
                finished(*_call_unit(job))
            return records
        # Processes, not threads: encoding holds the GIL between the library's calls. Spawned, so that they import
        # what they need whatever this process holds (threads, CUDA); a worker that dies fails the pool, not a hang.
        context = multiprocessing.get_context("spawn")
        init = (str(out), tokenizer.kind, os.getpid())
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=init) as pool:
            futures = [pool.submit(_call_unit, job) for job in jobs]
            try:
                for future in as_completed(futures):
                    finished(*future.result())
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return records
    finally:
        bar.close()


# ------------------------------------------------------------------------------------------------------ the index
def _write_index(out: Path, settings: Settings, tokenizer, source: str, records: list[dict]) -> dict:
    splits, skipped = {}, Skipped()
    for record in records:
        skipped.update(record["skipped"])
    for split in SPLITS:
        entries = [r[split] for r in records if r[split] is not None]
        splits[split] = split_section(entries, sum(r["text_bytes"][split] for r in records))
    for split, name in (("train", "training"), ("val", "validation")):
        if splits[split]["num_documents"] == 0:
            raise ValueError(
                f"--data {settings.data}: no document fell in the {name} split ({splits['train']['num_documents']} "
                f"train, {splits['val']['num_documents']} validation documents; a document's split follows a hash "
                "of its name, 5% to validation): give the source more documents"
            )
    index = {
        "tokenizer": tokenizer_section(tokenizer),
        "source": source,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "splits": splits,
        "skipped": dict(skipped),
        "settings": asdict(settings),
    }
    write_index(out, index)
    return read_index(out)


def describe(index: dict) -> str:
    """One line on what a shard folder holds."""
    s = index["splits"]
    skipped = ", ".join(f"{n:,} {what}" for what, n in sorted(index.get("skipped", {}).items()))
    return (
        f"{index['source']}: {s['train']['num_documents']:,} / {s['val']['num_documents']:,} train / validation "
        f"documents, {s['train']['num_tokens']:,} / {s['val']['num_tokens']:,} tokens ({index['dtype']}) in "
        f"{len(s['train']['shards'])} + {len(s['val']['shards'])} shards" + (f"; skipped {skipped}" if skipped else "")
    )
