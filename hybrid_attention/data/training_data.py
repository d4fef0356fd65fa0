"""What a run trains and validates on: the tokenizer and the two splits as shards, whatever `--data` names
(docs/training.md, "The loader").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybrid_attention.data.shards import ShardSet, fingerprint, is_shard_folder, open_split, read_index
from hybrid_attention.data.token_cache import cached_shards, tokenizer_section
from hybrid_attention.data.tokenize_corpus import PLAN
from hybrid_attention.data.tokenizer import DEFAULT_BPE_VOCAB, BPETokenizer, ByteTokenizer, tokenizer_from_dict

LEGACY_CHUNK = 1 << 24  # tokens hashed at a time for the fingerprint of runs saved before shards


@dataclass
class TrainingData:
    tokenizer: object
    train: ShardSet
    val: ShardSet
    source: str
    index: dict
    root: Path
    cached: bool  # read from the token cache rather than built now
    keep: object = field(default=None, repr=False)  # a temporary folder that must live as long as the run

    @property
    def fingerprint(self) -> dict:
        return fingerprint(self.index)

    @property
    def text_bytes(self) -> tuple[int, int]:
        s = self.index["splits"]
        return s["train"].get("text_bytes", 0), s["val"].get("text_bytes", 0)

    def legacy_fingerprint(self) -> dict:
        """The fingerprint runs saved before shards stored: a sha256 over both splits as int32 token ids."""
        digest = hashlib.sha256()
        for split in (self.train, self.val):
            digest.update(f"{split.num_tokens}:torch.int32:".encode())
            for start in range(0, split.num_tokens, LEGACY_CHUNK):
                digest.update(split.read(start, min(LEGACY_CHUNK, split.num_tokens - start)).astype(np.int32))
        return {"train_tokens": self.train.num_tokens, "val_tokens": self.val.num_tokens, "sha256": digest.hexdigest()}

    def close(self) -> None:
        self.train.close()
        self.val.close()


def _shard_tokenizer(root: Path, index: dict):
    section = index["tokenizer"]
    tokenizer = tokenizer_from_dict(section, root)
    if tokenizer_section(tokenizer)["sha256"] != section.get("sha256"):
        raise ValueError(
            f"{root}: its tokenizer is not the one its shards were written with (the index says otherwise)"
        )
    return tokenizer


def _refuse_records(spec: str | None) -> None:
    """JSON, JSON lines, Parquet and `datasets` folders are read by `tokenize` only: a clear error, not one text."""
    from hybrid_attention.data.formats import RECORD_SUFFIXES, dataset_folder

    path = Path(spec) if spec is not None else None
    if path is not None and ((path.is_file() and path.name.endswith(RECORD_SUFFIXES)) or dataset_folder(path)):
        raise ValueError(
            f"--data {spec} holds records, which `tokenize` reads: hybrid-attention tokenize --data {spec} --out "
            "SHARDS, then train --data SHARDS"
        )


def open_training_data(
    spec: str | None,
    *,
    max_bytes: int | None = None,
    tokenizer=None,
    new_tokenizer: str | None = None,
    vocab_size: int | None = None,
    verify: tuple[int, int] = (0, 1),
    splits: tuple[str, ...] = ("train", "val"),
    progress: bool = True,
) -> TrainingData:
    """Both splits of `spec` as shards.

    tokenizer: the run's own (on resume), which the data must be tokenized with; else `new_tokenizer` ("byte",
    "bpe" trained on the training split with `vocab_size`, or None: byte, or the shard folder's own). verify: (rank,
    world): this process checks the shards i of `splits` with i % world == rank, counted over both splits.
    """
    if spec is not None and (Path(spec) / PLAN).is_file() and not is_shard_folder(spec):
        raise ValueError(f"--data {spec} is an unfinished `tokenize`: run the same tokenize command again to finish it")
    if spec is not None and is_shard_folder(spec):
        if max_bytes is not None:
            raise ValueError(f"--data-max-bytes caps text read into memory; {spec} holds shards, read in place")
        root = Path(spec)
        index = read_index(root)
        own = _shard_tokenizer(root, index)
        if tokenizer is not None and tokenizer.identity() != own.identity():
            raise ValueError(f"--data {spec}: its shards were tokenized with another tokenizer than the run's")
        if new_tokenizer is not None and new_tokenizer != own.kind:
            raise ValueError(f"--data {spec} holds {own.kind} tokens; leave out --tokenizer, or pass {own.kind}")
        if vocab_size is not None and vocab_size != own.vocab_size:
            raise ValueError(f"--data {spec} has a vocabulary of {own.vocab_size}; leave out --vocab-size")
        data = TrainingData(
            own,
            open_split(root, index, "train"),
            open_split(root, index, "val"),
            f"{index['source']}, shards in {root}",
            index,
            root,
            cached=False,
        )
    else:
        from hybrid_attention.data.sources import load_corpus

        _refuse_records(spec)
        corpus = load_corpus(spec, max_bytes=max_bytes)
        if tokenizer is None and new_tokenizer == "bpe":
            tokenizer = BPETokenizer.train(corpus.train, vocab_size or DEFAULT_BPE_VOCAB)  # on its first 32 MB
        tokenizer = tokenizer or ByteTokenizer()
        cache = cached_shards(corpus, tokenizer, progress=progress)
        data = TrainingData(
            tokenizer,
            open_split(cache.root, cache.index, "train"),
            open_split(cache.root, cache.index, "val"),
            corpus.source,
            cache.index,
            cache.root,
            cached=cache.hit,
            keep=cache.temporary,
        )
        return data  # the cache checked its shards
    rank, world = verify
    first = len(data.train.entries)
    if "train" in splits:
        data.train.verify(range(rank, first, world))
    if "val" in splits:
        data.val.verify(range((rank - first) % world, len(data.val.entries), world))
    return data
