"""The token cache: the in-memory sources of `train --data` (built-in, python-env, a file, a folder, `hf:`) become the
same shards `tokenize` writes, the first time they are read (docs/training.md, "The loader").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid_attention.data.documents import Corpus
from hybrid_attention.data.shards import SPLITS, open_split, read_index, token_dtype, write_index, write_shard
from hybrid_attention.data.tokenizer import BPE_FILE
from hybrid_attention.files import atomic_write_text

FORMAT = "hybrid-attention tokens v2"
GROUP_BYTES = 16_000_000  # text per batch-encoding call: large enough to keep every core busy
SHARD_TOKENS = 1 << 24  # tokens per shard: 32 MiB of uint16


def cache_dir() -> Path:
    """The folder of cached token files: $HYBRID_ATTENTION_CACHE, else $XDG_CACHE_HOME/hybrid-attention, else
    ~/.cache/hybrid-attention."""
    if os.environ.get("HYBRID_ATTENTION_CACHE"):
        return Path(os.environ["HYBRID_ATTENTION_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybrid-attention"


def cache_key(corpus_digest: str, tokenizer) -> str:
    """sha256 (hex) naming the entry of this corpus under this tokenizer."""
    return hashlib.sha256("\n".join([FORMAT, corpus_digest, tokenizer.identity()]).encode("utf-8")).hexdigest()


def tokenizer_section(tokenizer) -> dict:
    """The index's record of a tokenizer: config.json's section and a sha256 of its identity."""
    return {**tokenizer.to_dict(), "sha256": hashlib.sha256(tokenizer.identity().encode()).hexdigest()}


def encode_in_groups(tokenizer, docs: list[str], group_chars: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """`tokenizer.encode_packed` over `docs` in order, about `group_chars` characters per call (each a batch the
    tokenizer encodes in parallel) -> (ids [N], lengths [D], characters) per group."""
    group, size = [], 0
    for i, doc in enumerate(docs):
        group.append(doc)
        size += len(doc)
        if size >= group_chars or i == len(docs) - 1:
            yield *tokenizer.encode_packed(group), size
            group, size = [], 0


class SplitWriter:
    """Documents of one split, appended in order, written as shards `{split}-{n:05d}.safetensors` of about
    `shard_tokens` tokens each (whole documents, so a shard may run over)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.entries: list[dict] = []
        self._ids: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._pending = 0

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        self._ids.append(ids)
        self._lengths.append(lengths)
        self._pending += ids.size
        if self._pending >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        path = self.root / f"{self.split}-{len(self.entries):05d}.safetensors"
        self.entries.append(write_shard(path, np.concatenate(self._ids), np.concatenate(self._lengths), self.dtype))
        self._ids, self._lengths, self._pending = [], [], 0


def write_corpus_shards(corpus: Corpus, tokenizer, root: Path, *, progress: bool = True, **index_fields) -> dict:
    """Encode both splits of `corpus` into shards in the folder `root` (created) and write its index; returns it."""
    from tqdm import tqdm

    root.mkdir(parents=True, exist_ok=True)
    if tokenizer.kind == "bpe":
        atomic_write_text(root / BPE_FILE, tokenizer.to_json())
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {}
    for split, docs, text_bytes in zip(SPLITS, (corpus.train, corpus.val), corpus.num_bytes, strict=True):
        writer = SplitWriter(root, split, dtype, SHARD_TOKENS)
        total = sum(len(d) for d in docs)
        desc = f"tokenizing {'validation' if split == 'val' else split}"
        with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
            for ids, lengths, size in encode_in_groups(tokenizer, docs, GROUP_BYTES):
                writer.add(ids, lengths)
                bar.update(size)
        writer.flush()
        splits[split] = split_section(writer.entries, text_bytes)
    index = {
        "tokenizer": tokenizer_section(tokenizer),
        "source": corpus.source,
        "dtype": dtype.name,
        "splits": splits,
        **index_fields,
    }
    write_index(root, index)
    return read_index(root)


def split_section(entries: list[dict], text_bytes: int) -> dict:
    """The index's section of one split: its shard entries and their totals."""
    return {
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "num_documents": sum(e["num_documents"] for e in entries),
        "text_bytes": text_bytes,
        "shards": entries,
    }


@dataclass
class CachedShards:
    root: Path
    index: dict
    hit: bool  # read from the cache, not built now
    temporary: tempfile.TemporaryDirectory | None = None  # holds the shards when the cache could not be written


def _valid_entry(root: Path, key: str) -> dict | None:
    try:
        index = read_index(root)
        if index.get("key") != key:
            return None
        for split in SPLITS:
            open_split(root, index, split).verify()
        return index
    except (ValueError, OSError):
        return None


def cached_shards(corpus: Corpus, tokenizer, *, cache: Path | None = None, progress: bool = True) -> CachedShards:
    """The shards of `corpus` under `tokenizer`, from the cache in `cache` (default `cache_dir()`) when it holds a
    valid entry, else built there (or in a temporary folder when the cache cannot be written)."""
    key = cache_key(corpus.digest(), tokenizer)
    final = (cache or cache_dir()) / "shards" / key
    if final.is_dir() and (index := _valid_entry(final, key)) is not None:
        return CachedShards(final, index, True)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        building = final.parent / f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            write_corpus_shards(corpus, tokenizer, building, progress=progress, key=key)
            if final.exists():  # a damaged entry (a valid one was returned above)
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.replace(building, final)
            except OSError:  # another job put its entry there first: use it if it checks out
                if (index := _valid_entry(final, key)) is None:
                    raise
                return CachedShards(final, index, False)
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
        return CachedShards(final, read_index(final), False)
    except OSError:
        temporary = tempfile.TemporaryDirectory(prefix="hybrid-attention-shards-")
        root = Path(temporary.name)
        index = write_corpus_shards(corpus, tokenizer, root, progress=progress, key=key)
        return CachedShards(root, index, False, temporary)
