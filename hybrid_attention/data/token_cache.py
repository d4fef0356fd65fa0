"""The tokenized-corpus cache: a corpus's train and validation token ids under one tokenizer, kept on disk.

Tokenizing a few hundred MB with a BPE takes longer than the rest of a run's start, and every run on the same corpus
with the same tokenizer would repeat it. So `encode_corpus` keeps one safetensors file per (corpus, tokenizer) in
`cache_dir()`: $HYBRID_ATTENTION_CACHE, else $XDG_CACHE_HOME/hybrid-attention, else ~/.cache/hybrid-attention.

- The key is a sha256 over the format version, `Corpus.digest()` and the tokenizer's identity (for a BPE its whole
  tokenizers JSON), so a changed corpus or tokenizer never reads another one's entry.
- The file holds `train` and `val` (uint16 when the vocabulary fits, else int32) and, as metadata, the key and a
  sha256 of the token bytes. A file that does not load, names another key or fails its checksum is rebuilt, never
  trusted. It is written atomically (`files.atomic_write`), so an interrupted write leaves no entry behind.
- Byte-tokenized corpora are not cached: their encoding is a copy of the text.

Encoding runs in groups of documents through the tokenizer's batch encoder (parallel over the machine's cores),
with a progress bar over the bytes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_attention.data.documents import Corpus
from hybrid_attention.files import atomic_write

FORMAT = "hybrid-attention tokens v1"
GROUP_BYTES = 16_000_000  # text per batch-encoding call: large enough to keep every core busy


@dataclass
class TokenizedCorpus:
    """Token ids of a corpus's splits ([N] int32 each) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    path: Path | None  # the cache file, or None when not cached
    hit: bool  # read from the cache


def cache_dir() -> Path:
    """The folder of cached token files (see the module docstring)."""
    if os.environ.get("HYBRID_ATTENTION_CACHE"):
        return Path(os.environ["HYBRID_ATTENTION_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybrid-attention"


def cache_key(corpus_digest: str, tokenizer) -> str:
    """sha256 (hex) naming the entry of this corpus under this tokenizer."""
    identity = tokenizer.to_json() if tokenizer.kind == "bpe" else tokenizer.kind
    return hashlib.sha256("\n".join([FORMAT, corpus_digest, identity]).encode("utf-8")).hexdigest()


def encode_with_progress(tokenizer, docs: list[str], *, desc: str, progress: bool = True) -> torch.Tensor:
    """tokenizer.encode_documents(docs) ([N] int32), in groups of about GROUP_BYTES of text, with a progress bar."""
    from tqdm import tqdm

    total = sum(len(d) for d in docs)
    parts, group, size = [], [], 0
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        for i, doc in enumerate(docs):
            group.append(doc)
            size += len(doc)
            if size >= GROUP_BYTES or i == len(docs) - 1:
                parts.append(tokenizer.encode_documents(group))
                bar.update(size)
                group, size = [], 0
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


def _checksum(train: torch.Tensor, val: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (train, val):
        h.update(t.numel().to_bytes(8, "little"))
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _load(path: Path, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The entry's (train, val) as int32, or None when the file is missing, unreadable, for another key or damaged."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            train, val = f.get_tensor("train"), f.get_tensor("val")
    except Exception:  # safetensors raises its own error types for truncated or malformed files
        return None
    if meta.get("format") != FORMAT or meta.get("key") != key or meta.get("checksum") != _checksum(train, val):
        return None
    return train.to(torch.int32), val.to(torch.int32)


def _store(path: Path, key: str, train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> None:
    from safetensors.torch import save_file

    dtype = torch.uint16 if vocab_size <= 2**16 else torch.int32
    train, val = train.to(dtype), val.to(dtype)
    meta = {"format": FORMAT, "key": key, "checksum": _checksum(train, val)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file({"train": train, "val": val}, tmp, metadata=meta))


def encode_corpus(tokenizer, corpus: Corpus, *, cache: Path | None = None, progress: bool = True) -> TokenizedCorpus:
    """Both splits of `corpus` as token ids, from the cache in `cache` (default `cache_dir()`) when it holds a valid
    entry, else encoded and stored there. A cache folder that cannot be written only costs the reuse."""
    if tokenizer.kind == "byte":
        train = tokenizer.encode_documents(corpus.train)
        return TokenizedCorpus(train, tokenizer.encode_documents(corpus.val), None, False)
    key = cache_key(corpus.digest(), tokenizer)
    path = (cache or cache_dir()) / "tokens" / f"{key}.safetensors"
    loaded = _load(path, key)
    if loaded is not None:
        return TokenizedCorpus(*loaded, path, True)
    train = encode_with_progress(tokenizer, corpus.train, desc="tokenizing train", progress=progress)
    val = encode_with_progress(tokenizer, corpus.val, desc="tokenizing validation", progress=progress)
    try:
        _store(path, key, train, val, tokenizer.vocab_size)
    except OSError:
        path = None
    return TokenizedCorpus(train, val, path, False)
