"""The token cache (hybrid_attention/data/token_cache.py): an in-memory corpus as shards, hits, keys, damaged
entries, an unwritable cache."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_attention.data import token_cache
from hybrid_attention.data.documents import Corpus
from hybrid_attention.data.shards import INDEX, open_split
from hybrid_attention.data.token_cache import cache_key, cached_shards
from hybrid_attention.data.tokenizer import BPETokenizer, ByteTokenizer

DOCS = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 5)}\n" for i in range(60)]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(DOCS, 300)


@pytest.fixture
def corpus():
    return Corpus(train=DOCS[:50], val=DOCS[50:], source="test")


def _tokens(cached, split):
    s = open_split(cached.root, cached.index, split)
    return s.read(0, s.num_tokens).astype(np.int64)


def _expected(tok, docs):
    return tok.encode_documents(docs).numpy().astype(np.int64)


def test_miss_then_hit_returns_the_same_tokens(bpe, corpus, tmp_path):
    first = cached_shards(corpus, bpe, cache=tmp_path, progress=False)
    assert not first.hit and first.root.parent == tmp_path / "shards" and (first.root / INDEX).is_file()
    assert np.array_equal(_tokens(first, "train"), _expected(bpe, corpus.train))
    assert np.array_equal(_tokens(first, "val"), _expected(bpe, corpus.val))
    assert first.index["splits"]["train"]["num_documents"] == 50
    second = cached_shards(corpus, bpe, cache=tmp_path, progress=False)
    assert second.hit and second.root == first.root
    assert np.array_equal(_tokens(second, "train"), _expected(bpe, corpus.train))
    assert [p.name for p in (tmp_path / "shards").iterdir()] == [first.root.name]  # no temporary left behind


def test_another_tokenizer_or_corpus_is_another_entry(bpe, corpus, tmp_path):
    first = cached_shards(corpus, bpe, cache=tmp_path, progress=False)
    other_tok = BPETokenizer.train(DOCS, 280)
    other = cached_shards(corpus, other_tok, cache=tmp_path, progress=False)
    assert not other.hit and other.root != first.root
    assert np.array_equal(_tokens(other, "train"), _expected(other_tok, corpus.train))
    changed = Corpus(train=corpus.train[:-1] + [corpus.train[-1] + " "], val=corpus.val, source="test")
    assert not cached_shards(changed, bpe, cache=tmp_path, progress=False).hit
    moved = Corpus(train=corpus.train[:-1], val=[corpus.train[-1], *corpus.val], source="test")  # same text, split
    assert cache_key(moved.digest(), bpe) != cache_key(corpus.digest(), bpe)
    assert cached_shards(corpus, bpe, cache=tmp_path, progress=False).hit  # the first entry is still there


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage_index", "other_key"])
def test_damaged_entry_is_rebuilt_not_trusted(bpe, corpus, tmp_path, damage):
    root = cached_shards(corpus, bpe, cache=tmp_path, progress=False).root
    shard = root / "train-00000.safetensors"
    raw = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":  # one token id changed: the file still reads, its SHA-256 does not match
        shard.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    elif damage == "garbage_index":
        (root / INDEX).write_bytes(b"\x00" * 64)
    else:  # a valid entry of another corpus under this name
        other = Corpus(train=DOCS[:40], val=DOCS[40:], source="test")
        (root / INDEX).write_bytes(
            (cached_shards(other, bpe, cache=tmp_path / "o", progress=False).root / INDEX).read_bytes()
        )
    again = cached_shards(corpus, bpe, cache=tmp_path, progress=False)
    assert not again.hit
    assert np.array_equal(_tokens(again, "train"), _expected(bpe, corpus.train))
    assert cached_shards(corpus, bpe, cache=tmp_path, progress=False).hit  # rewritten whole


def test_unwritable_cache_still_gives_shards(bpe, corpus, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = cached_shards(corpus, bpe, cache=blocker, progress=False)
    assert result.temporary is not None and not result.hit
    assert np.array_equal(_tokens(result, "val"), _expected(bpe, corpus.val))


def test_many_shards_and_groups_equal_one_encoding(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "GROUP_BYTES", 100)  # many encoding calls
    monkeypatch.setattr(token_cache, "SHARD_TOKENS", 300)  # many shards, whole documents each
    cached = cached_shards(corpus, ByteTokenizer(), cache=tmp_path, progress=False)
    assert len(cached.index["splits"]["train"]["shards"]) > 3
    assert np.array_equal(_tokens(cached, "train"), _expected(ByteTokenizer(), corpus.train))
    train = open_split(cached.root, cached.index, "train")
    ends = np.flatnonzero(train.read(0, train.num_tokens) == 0xFF) + 1  # each document ends with byte 0xFF
    assert np.array_equal(np.concatenate([[0], ends[:-1]]), [0, *train.document_starts(0, train.num_tokens)])


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRID_ATTENTION_CACHE", str(tmp_path / "a"))
    assert token_cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("HYBRID_ATTENTION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert token_cache.cache_dir() == tmp_path / "x" / "hybrid-attention"
