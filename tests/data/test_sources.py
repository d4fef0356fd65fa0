"""Data sources, splits, batches, baselines and tokenizers (hybrid_attention/data/sources.py, tokenizer.py)."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid_attention.data import sources
from hybrid_attention.data.documents import in_validation
from hybrid_attention.data.loader import eval_starts
from hybrid_attention.data.shards import open_split, read_index, write_index, write_shard
from hybrid_attention.data.sources import load_corpus
from hybrid_attention.data.tokenizer import BPETokenizer, ByteTokenizer, byte_alphabet, tokenizer_from_dict
from hybrid_attention.data.unigram import unigram_baseline, unigram_loss

SAMPLE = "héllo wörld 🙂\n\tdef f(x):\n        return x ** 2  # naïve\n"


def _sha_fraction(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2.0**64


# ------------------------------------------------------------------------------------------------- built-in corpus
def test_builtin_corpus_split_by_hashlib_of_relative_path_and_capped():
    cap = 150_000
    corpus = load_corpus(None, max_bytes=cap)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert corpus.train and corpus.val and corpus.train_names and corpus.val_names
    for name in corpus.train_names + corpus.val_names:
        assert name.endswith(".py") and not Path(name).is_absolute()
        assert "site-packages" not in name and "dist-packages" not in name
        assert (root / name).is_file()
    assert all(_sha_fraction(n) < sources.VAL_FRACTION for n in corpus.val_names)
    assert all(_sha_fraction(n) >= sources.VAL_FRACTION for n in corpus.train_names)
    assert not set(corpus.train_names) & set(corpus.val_names)
    # Whole files, read exactly as they are on disk.
    assert corpus.train[0] == (root / corpus.train_names[0]).read_text(encoding="utf-8")
    n_train, n_val = corpus.num_bytes
    assert 0 < n_train <= (1 - sources.VAL_FRACTION) * cap and 0 < n_val
    assert load_corpus(None, max_bytes=cap).val_names == corpus.val_names  # deterministic


def test_builtin_split_does_not_depend_on_python_hash_seed():
    code = "from hybrid_attention.data.sources import load_corpus; print(load_corpus(None, max_bytes=60000).val_names)"
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True))
    assert outs[0].stdout == outs[1].stdout == f"{load_corpus(None, max_bytes=60000).val_names}\n"


def test_default_cap_applies_to_builtin_only():
    corpus = load_corpus(None)
    assert sum(corpus.num_bytes) <= sources.BUILTIN_MAX_BYTES


# ------------------------------------------------------------------------------------------------------ local data
def test_directory_corpus_reads_text_files_recursively(tmp_path):
    names = [f"d{i % 3}/file{i}.{('txt', 'md', 'py')[i % 3]}" for i in range(40)]
    for i, name in enumerate(names):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"document {i}\n" * (i + 1), encoding="utf-8")
    (tmp_path / "ignored.bin").write_bytes(b"\xff\x00" * 100)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden\n")
    corpus = load_corpus(str(tmp_path))
    assert sorted(corpus.train_names + corpus.val_names) == sorted(names)
    assert all(in_validation(n) for n in corpus.val_names) and not any(in_validation(n) for n in corpus.train_names)
    by_name = dict(zip(corpus.train_names + corpus.val_names, corpus.train + corpus.val, strict=True))
    assert by_name["d1/file7.md"] == "document 7\n" * 8


def test_a_file_that_is_not_utf8_in_a_folder_is_skipped_and_counted(tmp_path):
    for i in range(60):
        (tmp_path / f"good{i}.txt").write_text(f"document {i}\n" * 3, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    corpus = load_corpus(str(tmp_path))
    assert len(corpus.train_names) + len(corpus.val_names) == 60 and "latin1.txt" not in corpus.train_names
    assert "1 that are not UTF-8 skipped (e.g. latin1.txt)" in corpus.source


def test_single_file_is_split_by_text_at_a_line(tmp_path):
    lines = [f"line {i} {'x' * (i % 7)}" for i in range(500)]
    path = tmp_path / "one.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = load_corpus(str(path))
    (train,), (val,) = corpus.train, corpus.val
    assert train + val == path.read_text()
    assert train.endswith("\n") and 0.03 < len(val) / (len(train) + len(val)) < 0.07


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "no such file or directory"),
        ("empty.txt", b"", "holds no text"),
        ("blank.txt", b" \n\n ", "holds no text"),
        ("latin1.txt", b"ok\n\xe9t\xe9\n", r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"),
        ("x.txt", b"x", "too small to split"),
    ],
)
def test_bad_data_files_raise_value_error(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_corpus(str(tmp_path / name))


def test_directory_without_text_files_raises(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no .txt/.md/.py files"):
        load_corpus(str(tmp_path))


def test_invalid_cap_and_fraction_raise():
    with pytest.raises(ValueError, match="byte cap"):
        load_corpus(None, max_bytes=0)
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(None, val_fraction=1.0)


# ------------------------------------------------------------------------------------------------ hf: (faked here)
def test_hf_data_reads_text_column_through_datasets(monkeypatch):
    rows = lambda prefix, n: [{"text": f"{prefix} row {i}\n" * 3, "id": i} for i in range(n)]
    calls = []
    fake = types.SimpleNamespace(
        load_dataset=lambda *a: calls.append(a) or {"train": rows("train", 50), "validation": rows("val", 5)}
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    corpus = load_corpus("hf:someone/corpus:small")
    assert calls == [("someone/corpus", "small")]
    assert corpus.train == [r["text"] for r in rows("train", 50)] and corpus.val == [r["text"] for r in rows("val", 5)]
    capped = load_corpus("hf:someone/corpus", max_bytes=400)
    assert 0 < len(capped.train) < 50 and sum(capped.num_bytes) <= 400 + 2 * len(rows("train", 1)[0]["text"])


def test_hf_data_never_runs_a_loading_script(monkeypatch):
    """Where datasets still takes `trust_remote_code`, it is passed as False; where the keyword is gone (datasets 4,
    which runs no scripts), nothing is added that it would reject."""
    calls = []

    def with_flag(*args, trust_remote_code=None):
        calls.append(("flag", args, trust_remote_code))
        return {"train": [{"text": "a b c\n" * 40}]}

    def without_flag(*args):
        calls.append(("no flag", args))
        return {"train": [{"text": "a b c\n" * 40}]}

    for fn in (with_flag, without_flag):
        monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fn))
        load_corpus("hf:someone/corpus")
    assert calls == [("flag", ("someone/corpus",), False), ("no flag", ("someone/corpus",))]


def test_data_that_is_neither_file_nor_directory_is_named_so():
    with pytest.raises(ValueError, match="/dev/null: neither a regular file nor a directory"):
        load_corpus("/dev/null")


def test_hf_data_without_validation_split_is_split_by_row_hash(monkeypatch):
    fake = types.SimpleNamespace(load_dataset=lambda *a: {"train": [{"body": f"doc {i}\n"} for i in range(400)]})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    corpus = load_corpus("hf:local")
    assert len(corpus.train) + len(corpus.val) == 400 and 0 < len(corpus.val) < 60
    assert corpus.val_names == [f"row-{i}" for i in range(400) if in_validation(f"row-{i}")]


def test_hf_data_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as when the package is not installed
    with pytest.raises(
        ValueError, match=r"needs the optional `datasets` package: pip install 'hybrid-attention\[data\]'"
    ):
        load_corpus("hf:anything")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a: {"test": []}))
    with pytest.raises(ValueError, match="no 'train' split"):
        load_corpus("hf:x")
    with pytest.raises(ValueError, match="expected hf:NAME or hf:NAME:CONFIG"):
        load_corpus("hf:")

    def offline(*a):
        raise ConnectionError("offline and not cached")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(ValueError, match="could not load it: ConnectionError: offline and not cached"):
        load_corpus("hf:x")


# ---------------------------------------------------------------------------------------------------------- batches
def test_eval_starts_are_fixed_and_inside_the_split():
    starts = eval_starts(10_000, 4, 50, 3)
    assert starts.tolist() == eval_starts(10_000, 4, 50, 3).tolist() and len(starts) == 12
    assert starts[0] == 0 and starts[-1] == 10_000 - 50 and bool((starts[1:] - starts[:-1] >= 50).all())
    assert eval_starts(1030, 8, 100, None).tolist() == list(range(0, 1000, 100))
    # Over 2**24 + 2048 + 1 tokens the last window ends exactly at the last token (n - seq_len is odd and above
    # 2**24, where float32 holds only even integers).
    n, seq_len = 2**24 + 2048 + 1, 2048
    assert int(eval_starts(n, 4, seq_len, 2)[-1]) == n - seq_len
    with pytest.raises(ValueError, match="fewer than one window of --seq-len 21"):
        eval_starts(20, 2, 21, None)


def test_unigram_loss_matches_direct_computation():
    train = torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32)
    val = torch.tensor([0, 2, 3])
    counts = [3 + 1, 1 + 1, 2 + 1, 0 + 1]
    expected = -sum(math.log(counts[t] / sum(counts)) for t in val.tolist()) / 3
    assert abs(unigram_loss(train, val, 4) - expected) < 1e-12


def test_unigram_baseline_on_whole_shards_is_unigram_loss(tmp_path):
    """The baseline a run reports (read from shards a chunk at a time) is `unigram_loss` of the whole splits, and its
    bits per byte divide by the text bytes, the end-of-document ids holding none."""
    tok = ByteTokenizer()
    rng = np.random.default_rng(7)
    docs = {
        s: ["".join(rng.choice(list("abcdé \n"), rng.integers(1, 40))) for _ in range(n)]
        for s, n in [("train", 31), ("val", 7)]
    }
    splits, ids = {}, {}
    for s, d in docs.items():
        ids[s], lengths = tok.encode_packed(d)
        splits[s] = {"shards": [write_shard(tmp_path / f"{s}.safetensors", ids[s], lengths, np.dtype("uint16"))]}
    write_index(tmp_path, {"tokenizer": {}, "source": "t", "dtype": "uint16", "splits": splits})
    index = read_index(tmp_path)
    train, val = open_split(tmp_path, index, "train"), open_split(tmp_path, index, "val")
    loss, bpb = unigram_baseline(train, val, tok, max_tokens=1 << 20)
    expected = unigram_loss(
        torch.from_numpy(ids["train"].astype(np.int64)), torch.from_numpy(ids["val"].astype(np.int64)), 256
    )
    text_bytes = sum(len(d.encode("utf-8")) for d in docs["val"])
    assert math.isfinite(loss) and abs(loss - expected) < 1e-9
    assert abs(bpb - expected * ids["val"].size / math.log(2) / text_bytes) < 1e-9


# ------------------------------------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode()) and tok.decode(ids) == SAMPLE
    joined = tok.encode_documents(["ab", "é"])  # each document ends with 0xFF, never a byte of UTF-8 text
    assert joined.dtype == torch.int32 and joined.tolist() == list(b"ab\xff\xc3\xa9\xff")
    assert b"".join(tok.token_bytes(i) for i in ids) == SAMPLE.encode()
    assert tok.token_bytes(255) == b"" and tok.decode(joined.tolist()) == "abé"
    assert tok.byte_lengths().tolist() == [1] * 255 + [0]
    ids, lengths = tok.encode_packed(["ab", "é", ""])
    assert ids.tolist() == list(b"ab\xff\xc3\xa9\xff\xff") and lengths.tolist() == [3, 3, 1]


def test_byte_tokenizer_of_older_runs_ends_documents_with_a_newline():
    legacy = tokenizer_from_dict({"kind": "byte", "vocab_size": 256}, ".")  # config.json before the end token
    assert legacy.eod_id is None and legacy.encode_documents(["ab", "é"]).tolist() == list(b"ab\n\xc3\xa9\n")
    assert legacy.byte_lengths().tolist() == [1] * 256 and legacy.token_bytes(255) == b"\xff"
    assert tokenizer_from_dict(ByteTokenizer().to_dict(), ".").eod_id == 255


def test_byte_alphabet_matches_tokenizers_library():
    from tokenizers import pre_tokenizers

    table = byte_alphabet()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_bpe_train_round_trip_save_load(tmp_path):
    docs = load_corpus(None, max_bytes=120_000).train
    tok = BPETokenizer.train(docs, 600)
    assert tok.vocab_size == 600
    for text in (SAMPLE, docs[0][:2000], "\x00\x01 odd \r\n bytes \u2028"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert len(tok.encode(docs[0])) < 0.6 * len(docs[0].encode())  # it actually merges
    lengths = tok.byte_lengths()
    ids = tok.encode(SAMPLE)
    assert int(lengths[ids].sum()) == len(SAMPLE.encode())
    (tmp_path / "tokenizer.json").write_text(tok.to_json())
    again = tokenizer_from_dict(tok.to_dict(), tmp_path)
    assert again.encode(SAMPLE) == ids
    assert torch.equal(again.encode_documents(docs[:3]), tok.encode_documents(docs[:3]))
    with pytest.raises(ValueError, match="has 600 tokens but config.json says 700"):
        tokenizer_from_dict({**tok.to_dict(), "vocab_size": 700}, tmp_path)
    with pytest.raises(ValueError, match="at least 256"):
        BPETokenizer.train(docs, 100)
    with pytest.raises(ValueError, match="unknown tokenizer kind 'word'"):
        tokenizer_from_dict({"kind": "word"}, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        tokenizer_from_dict(tok.to_dict(), tmp_path)


def test_bpe_ends_documents_with_its_special_token_and_reads_it_as_text_inside_one():
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(50)]
    tok = BPETokenizer.train(docs, 300)
    assert tok.eod_id == 0 and tok.token_bytes(0) == b"" and int(tok.byte_lengths()[0]) == 0
    ids, lengths = tok.encode_packed(docs[:3])
    ends = np.cumsum(lengths) - 1
    assert ids[ends].tolist() == [0, 0, 0] and np.count_nonzero(ids == 0) == 3
    assert ids[: lengths[0] - 1].tolist() == tok.encode(docs[0])
    spelled = "a <|endoftext|> b"  # a document that names the token is text, not two documents
    assert 0 not in tok.encode(spelled) and tok.decode(tok.encode(spelled)) == spelled


def test_a_bpe_without_an_end_token_gets_one_or_keeps_its_newline():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = [f"word{i} other{i}\n" for i in range(40)]
    raw = Tokenizer(models.BPE())  # trained as before the end token: no special token
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    raw.train_from_iterator(docs, trainer=trainer)
    old = BPETokenizer(raw)
    assert old.eod_id is None
    assert old.encode_documents(docs[:2]).tolist() == old.encode(docs[0] + "\n") + old.encode(docs[1] + "\n")
    new = old.with_eod()
    assert new.eod_id == old.vocab_size and new.vocab_size == old.vocab_size + 1 and new.with_eod() is new
    assert new.encode_packed(docs[:1])[0].tolist() == old.encode(docs[0]) + [new.eod_id]


def test_bpe_trains_on_the_first_documents_up_to_its_byte_cap():
    docs = load_corpus(None, max_bytes=60_000).train
    cut = next(i for i in range(1, len(docs)) if sum(map(len, docs[: i + 1])) > 30_000)
    capped = BPETokenizer.train(docs, 400, max_bytes=30_000)
    assert capped.to_json() == BPETokenizer.train(docs[:cut], 400).to_json()
    assert capped.to_json() != BPETokenizer.train(docs, 400).to_json()
    assert BPETokenizer.train(docs, 300, max_bytes=1).to_json() == BPETokenizer.train(docs[:1], 300).to_json()


def test_corpus_digest_covers_text_order_and_split():
    a = sources.Corpus(train=["ab", "c"], val=["d"], source="x")
    assert a.digest() == sources.Corpus(train=["ab", "c"], val=["d"], source="another name").digest()
    for other in (
        sources.Corpus(train=["a", "bc"], val=["d"], source="x"),  # same bytes, other documents
        sources.Corpus(train=["c", "ab"], val=["d"], source="x"),
        sources.Corpus(train=["ab"], val=["c", "d"], source="x"),
        sources.Corpus(train=["ab", "c"], val=["e"], source="x"),
    ):
        assert other.digest() != a.digest()
    assert load_corpus(None, max_bytes=30_000).digest() == load_corpus(None, max_bytes=30_000).digest()
