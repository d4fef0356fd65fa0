"""Shards (hybrid_attention/data/shards.py): reading a split in place across shard ends, document starts, checksums
that catch damage, an index that names nothing outside its folder, and the fingerprint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybrid_attention.data.shards import (
    INDEX,
    ShardSet,
    fingerprint,
    open_split,
    read_index,
    token_dtype,
    write_index,
    write_shard,
)


def _folder(tmp_path, docs_per_shard, dtype=np.uint16, seed=0):
    """Shards of random documents; returns (root, index, the whole stream, the document starts)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries, stream, starts = [], [], []
    for i, lengths in enumerate(docs_per_shard):
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = rng.integers(0, 60000, int(lengths.sum())).astype(dtype)
        starts += list(sum(map(len, stream)) + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        stream.append(ids)
        entries.append(write_shard(tmp_path / f"train-{i:05d}.safetensors", ids, lengths, np.dtype(dtype)))
    empty = {"num_tokens": 0, "num_documents": 0, "shards": []}
    write_index(
        tmp_path,
        {
            "tokenizer": {"kind": "byte"},
            "source": "test",
            "dtype": np.dtype(dtype).name,
            "splits": {"train": {"shards": entries}, "val": empty},
        },
    )
    return tmp_path, read_index(tmp_path), np.concatenate(stream).astype(np.int64), np.array(starts)


def test_reads_and_document_starts_match_the_stream_across_shards(tmp_path):
    root, index, stream, starts = _folder(tmp_path, [[5, 1, 30], [7], [2, 2, 2, 40], [1]])
    split = open_split(root, index, "train")
    assert split.num_tokens == stream.size == 90 and split.num_documents == 9
    for start in range(split.num_tokens):
        for length in (1, 2, 7, 36, split.num_tokens - start):
            if start + length > split.num_tokens:
                continue
            assert np.array_equal(split.read(start, length), stream[start : start + length])
            inside = starts[(starts > start) & (starts < start + length)] - start
            assert np.array_equal(split.document_starts(start, length), inside)
    windows = split.windows(np.array([0, 33, 80]), 10)
    assert windows.dtype == np.int64 and np.array_equal(windows[1], stream[33:43])
    with pytest.raises(ValueError, match="outside the split"):
        split.read(85, 10)
    split.close()


def test_uint32_shards_for_large_vocabularies(tmp_path):
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32
    root, index, stream, _ = _folder(tmp_path, [[3, 4]], dtype=np.uint32)
    assert np.array_equal(open_split(root, index, "train").read(0, 7), stream)


def test_many_shards_are_read_with_few_open_files(tmp_path, monkeypatch):
    from hybrid_attention.data import shards

    monkeypatch.setattr(shards, "_OPEN_SHARDS", 2)
    root, index, stream, _ = _folder(tmp_path, [[3]] * 7)
    split = ShardSet(root, index["splits"]["train"]["shards"])
    assert np.array_equal(split.read(0, 21), stream) and len(split._open) <= 2
    assert np.array_equal(split.read(2, 3), stream[2:5])


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_checksums_catch_a_damaged_shard(tmp_path, damage):
    root, index, _, _ = _folder(tmp_path, [[5, 6], [7, 8]])
    path = root / "train-00001.safetensors"
    raw = bytearray(path.read_bytes())
    if damage == "flip":  # one token id, the file's size unchanged
        raw[-5] ^= 1
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[:-4]))
    else:
        path.unlink()
    split = open_split(root, index, "train")
    split.verify(range(0, 1))  # the other shard is fine
    with pytest.raises(ValueError, match="train-00001.safetensors (is damaged|is missing)"):
        split.verify()


def test_index_errors_are_clear(tmp_path):
    root, index, _, _ = _folder(tmp_path, [[3]])
    with pytest.raises(ValueError, match="holds no index.json"):
        read_index(tmp_path / "nowhere")
    raw = json.loads((root / INDEX).read_text())
    raw["splits"]["train"]["shards"][0]["file"] = "../elsewhere.safetensors"
    (root / INDEX).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="shard entry is damaged"):
        read_index(root)
    (root / INDEX).write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not written by `hybrid-attention tokenize`"):
        read_index(root)


def test_fingerprint_follows_every_shard(tmp_path):
    _, a, _, _ = _folder(tmp_path / "a", [[3, 4], [5]])
    _, b, _, _ = _folder(tmp_path / "b", [[3, 4], [5]])
    _, c, _, _ = _folder(tmp_path / "c", [[3, 4], [5]], seed=1)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    assert fingerprint(a)["train_tokens"] == 12 and fingerprint(a)["format"] == "shards"


def test_write_shard_refuses_lengths_that_do_not_add_up(tmp_path):
    with pytest.raises(ValueError, match="sum to 3, not to the 4 ids"):
        write_shard(tmp_path / "x.safetensors", np.arange(4), np.array([1, 2]), np.dtype(np.uint16))
