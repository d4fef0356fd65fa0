"""The tokenized-corpus cache (hybrid_attention/data/token_cache.py): hits, keys, damaged files, progress groups."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.data import token_cache
from hybrid_attention.data.documents import Corpus
from hybrid_attention.data.token_cache import cache_key, encode_corpus, encode_with_progress
from hybrid_attention.data.tokenizer import BPETokenizer, ByteTokenizer

DOCS = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 5)}\n" for i in range(60)]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(DOCS, 300)


@pytest.fixture
def corpus():
    return Corpus(train=DOCS[:50], val=DOCS[50:], source="test")


def _expected(tok, corpus):
    return tok.encode_documents(corpus.train), tok.encode_documents(corpus.val)


def test_miss_then_hit_returns_the_same_tokens(bpe, corpus, tmp_path):
    first = encode_corpus(bpe, corpus, cache=tmp_path, progress=False)
    assert not first.hit and first.path.is_file() and first.path.parent == tmp_path / "tokens"
    train, val = _expected(bpe, corpus)
    assert torch.equal(first.train, train) and torch.equal(first.val, val)
    second = encode_corpus(bpe, corpus, cache=tmp_path, progress=False)
    assert second.hit and second.path == first.path
    assert second.train.dtype == torch.int32 and torch.equal(second.train, train) and torch.equal(second.val, val)
    assert [p.name for p in (tmp_path / "tokens").iterdir()] == [first.path.name]  # no temporary left behind


def test_another_tokenizer_or_corpus_is_another_entry(bpe, corpus, tmp_path):
    first = encode_corpus(bpe, corpus, cache=tmp_path, progress=False)
    other_tok = BPETokenizer.train(DOCS, 280)
    other = encode_corpus(other_tok, corpus, cache=tmp_path, progress=False)
    assert not other.hit and other.path != first.path
    assert torch.equal(other.train, other_tok.encode_documents(corpus.train))
    changed = Corpus(train=corpus.train[:-1] + [corpus.train[-1] + " "], val=corpus.val, source="test")
    assert not encode_corpus(bpe, changed, cache=tmp_path, progress=False).hit
    moved = Corpus(train=corpus.train[:-1], val=[corpus.train[-1], *corpus.val], source="test")  # same text, split
    assert cache_key(moved.digest(), bpe) != cache_key(corpus.digest(), bpe)
    assert encode_corpus(bpe, corpus, cache=tmp_path, progress=False).hit  # the first entry is still there


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "other_key"])
def test_damaged_entry_is_rebuilt_not_trusted(bpe, corpus, tmp_path, damage):
    path = encode_corpus(bpe, corpus, cache=tmp_path, progress=False).path
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":  # one token id changed: the file still loads, the checksum does not match
        path.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:  # a valid entry of another corpus under this name
        other = Corpus(train=DOCS[:40], val=DOCS[40:], source="test")
        path.write_bytes(encode_corpus(bpe, other, cache=tmp_path / "o", progress=False).path.read_bytes())
    again = encode_corpus(bpe, corpus, cache=tmp_path, progress=False)
    assert not again.hit
    train, val = _expected(bpe, corpus)
    assert torch.equal(again.train, train) and torch.equal(again.val, val)
    assert encode_corpus(bpe, corpus, cache=tmp_path, progress=False).hit  # rewritten whole


def test_unwritable_cache_still_encodes(bpe, corpus, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = encode_corpus(bpe, corpus, cache=blocker, progress=False)
    assert result.path is None and not result.hit and torch.equal(result.train, _expected(bpe, corpus)[0])


def test_byte_tokenizer_is_not_cached(corpus, tmp_path):
    result = encode_corpus(ByteTokenizer(), corpus, cache=tmp_path, progress=False)
    assert result.path is None and not (tmp_path / "tokens").exists()
    assert torch.equal(result.val, ByteTokenizer().encode_documents(corpus.val))


def test_grouped_encoding_equals_one_call(bpe, monkeypatch):
    monkeypatch.setattr(token_cache, "GROUP_BYTES", 100)  # many groups
    assert torch.equal(encode_with_progress(bpe, DOCS, desc="t", progress=False), bpe.encode_documents(DOCS))
    assert encode_with_progress(bpe, [], desc="t", progress=False).numel() == 0


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRID_ATTENTION_CACHE", str(tmp_path / "a"))
    assert token_cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("HYBRID_ATTENTION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert token_cache.cache_dir() == tmp_path / "x" / "hybrid-attention"
