"""`tokenize` (hybrid_attention/data/tokenize_corpus.py, formats.py): every source format round-trips into shards, the
validation split follows document names, a killed run resumes, and settings or sources that changed are refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid_attention.data.documents import in_validation
from hybrid_attention.data.shards import INDEX, open_split, read_index
from hybrid_attention.data.tokenize_corpus import PARTS, Settings, tokenize
from hybrid_attention.data.tokenizer import BPETokenizer, ByteTokenizer
from tests.helpers import checkout_env

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _text(rng, words=40) -> str:
    vocab = ["def", "return", "x", "é", "🙂", "value", "\n", "    ", "(", ")", "the", "data"]
    return " ".join(rng.choice(vocab, words)) + "\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A folder of every file format, and the documents each file holds: {file name: [(doc name, text)]}."""
    root = tmp_path_factory.mktemp("source")
    rng = np.random.default_rng(0)
    docs = {}
    for i in range(30):
        name = f"{'sub/' if i % 3 else ''}t{i:02d}.{('txt', 'md', 'py')[i % 3]}"
        (root / name).parent.mkdir(exist_ok=True)
        text = _text(rng, 20 + i)
        (root / name).write_text(text, encoding="utf-8")
        docs[name] = [(name, text)]
    (root / "latin1.txt").write_bytes(b"caf\xe9\n")  # skipped and counted
    docs["latin1.txt"] = []
    lines, docs["records.jsonl"], at = [], [], 0
    for i in range(80):
        record = {"text": _text(rng), "id": i} if i % 17 else {"body": "no text field"}
        line = b"not json\n" if i == 40 else (json.dumps(record) + "\n").encode()  # skipped and counted
        if i != 40 and "text" in record:
            docs["records.jsonl"].append((f"records.jsonl@{at}", record["text"]))
        lines.append(line)
        at += len(line)
    (root / "records.jsonl").write_bytes(b"".join(lines))
    array = [_text(rng) for _ in range(100)]
    (root / "array.json").write_text(json.dumps([{"text": t} for t in array]))
    docs["array.json"] = [(f"array.json#{i}", t) for i, t in enumerate(array)]
    rows = [_text(rng) for _ in range(60)]
    pq.write_table(pa.table({"text": rows, "n": list(range(60))}), root / "table.parquet", row_group_size=16)
    docs["table.parquet"] = [(f"table.parquet#{i}", t) for i, t in enumerate(rows)]
    return root, docs


def _expected(docs: dict, tokenizer, split: str) -> np.ndarray:
    ordered = [(n, t) for name in sorted(docs) for n, t in docs[name]]
    texts = [t for n, t in ordered if in_validation(n) == (split == "val")]
    return tokenizer.encode_packed(texts)[0].astype(np.int64), len(texts)


def _stream(out, split):
    index = read_index(out)
    s = open_split(out, index, split)
    return s.read(0, s.num_tokens).astype(np.int64), s.num_documents


def test_a_folder_of_every_format_round_trips(source, tmp_path):
    root, docs = source
    index = tokenize(Settings(data=str(root), shard_tokens=1500), tmp_path / "a", workers=1, progress=False)
    for split in ("train", "val"):
        tokens, count = _stream(tmp_path / "a", split)
        expected, expected_count = _expected(docs, ByteTokenizer(), split)
        assert count == expected_count > 0 and np.array_equal(tokens, expected), split
    assert index["skipped"] == {
        "files that are not UTF-8": 1,
        "lines that are not JSON or not UTF-8": 1,
        "records without the text field": 5,
    }
    assert len(index["splits"]["train"]["shards"]) > 5
    # Two processes write the same shards.
    again = tokenize(Settings(data=str(root), shard_tokens=1500), tmp_path / "b", workers=2, progress=False)
    assert [e["sha256"] for e in again["splits"]["train"]["shards"]] == [
        e["sha256"] for e in index["splits"]["train"]["shards"]
    ]


def test_strict_refuses_what_is_otherwise_skipped(source, tmp_path):
    root, _ = source
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        tokenize(Settings(data=str(root), strict=True), tmp_path / "s", workers=1, progress=False)


@pytest.mark.parametrize("name", ["records.jsonl", "array.json", "table.parquet"])
def test_single_record_files_round_trip(source, tmp_path, name):
    root, docs = source
    tokenize(Settings(data=str(root / name), shard_tokens=500), tmp_path / name, workers=1, progress=False)
    for split in ("train", "val"):
        tokens, _ = _stream(tmp_path / name, split)
        assert np.array_equal(tokens, _expected({name: docs[name]}, ByteTokenizer(), split)[0])


def test_a_datasets_folder_keeps_its_own_validation_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(1)
    train, val = [_text(rng) for _ in range(50)], [_text(rng) for _ in range(7)]
    splits = {
        "train": datasets.Dataset.from_dict({"content": train}),
        "validation": datasets.Dataset.from_dict({"content": val}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match="no column 'text'"):
        tokenize(Settings(data=str(tmp_path / "ds")), tmp_path / "bad", workers=1, progress=False)
    index = tokenize(
        Settings(data=str(tmp_path / "ds"), text_field="content", shard_tokens=700),
        tmp_path / "o",
        workers=1,
        progress=False,
    )
    tok = ByteTokenizer()
    assert np.array_equal(_stream(tmp_path / "o", "train")[0], tok.encode_packed(train)[0])
    assert np.array_equal(_stream(tmp_path / "o", "val")[0], tok.encode_packed(val)[0])
    assert "its validation split as validation" in index["source"]


def test_bpe_and_given_tokenizers_end_documents_with_their_token(source, tmp_path):
    root, docs = source
    index = tokenize(
        Settings(data=str(root), tokenizer="bpe", vocab_size=300), tmp_path / "bpe", workers=1, progress=False
    )
    tok = BPETokenizer.load(tmp_path / "bpe" / "tokenizer.json")
    assert index["tokenizer"]["kind"] == "bpe" and tok.eod_id == 0
    assert np.array_equal(_stream(tmp_path / "bpe", "val")[0], _expected(docs, tok, "val")[0])
    # A rerun reads the saved tokenizer back instead of training another: nothing to do.
    assert (
        tokenize(
            Settings(data=str(root), tokenizer="bpe", vocab_size=300),
            tmp_path / "bpe",
            progress=False,
            echo=lambda *a: None,
        )
        == index
    )
    # A tokenizer.json without an end-of-document token (trained as runs did before it) gets one, as its last id.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(
        ["some text"] * 5,
        trainers.BpeTrainer(vocab_size=270, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    raw.save(str(tmp_path / "plain.json"))
    given = tokenize(
        Settings(data=str(root / "table.parquet"), tokenizer=str(tmp_path / "plain.json")),
        tmp_path / "given",
        workers=1,
        progress=False,
    )
    assert given["tokenizer"]["eod_id"] == given["tokenizer"]["vocab_size"] - 1


def test_other_settings_or_a_changed_source_are_refused(source, tmp_path):
    root, _ = source
    small = tmp_path / "src"
    small.mkdir()
    for i in range(40):
        (small / f"f{i}.txt").write_text(f"document {i}\n" * 5)
    tokenize(Settings(data=str(small)), tmp_path / "o", workers=1, progress=False)
    with pytest.raises(ValueError, match="already holds shards of other settings"):
        tokenize(Settings(data=str(small), shard_tokens=10), tmp_path / "o", workers=1, progress=False)
    (tmp_path / "o" / INDEX).unlink()  # as if it had stopped before the end
    (small / "f0.txt").write_text("changed\n")
    with pytest.raises(ValueError, match="changed since"):
        tokenize(Settings(data=str(small)), tmp_path / "o", workers=1, progress=False)
    with pytest.raises(ValueError, match="unfinished tokenize of other settings"):
        tokenize(Settings(data=str(small), text_field="body"), tmp_path / "o", workers=1, progress=False)


def test_a_killed_tokenize_resumes_keeping_its_checked_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(2)
    with open(src / "big.jsonl", "w") as f:
        for _ in range(2500):
            f.write(json.dumps({"text": _text(rng, 60)}) + "\n")
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "hybrid_attention",
        "tokenize",
        "--data",
        str(src),
        "--out",
        str(out),
        "--shard-tokens",
        "8000",
        "--workers",
        "2",
    ]
    env = checkout_env()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((out / PARTS).glob("*.json")) if (out / PARTS).is_dir() else []) < 4:
        time.sleep(0.01)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert workers, "the run had no worker processes when it was killed"
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers), "a worker outlived the killed tokenize"
    assert not (out / INDEX).exists(), "the run ended before it was killed: give it more to do"
    parts = sorted((out / PARTS).glob("*.json"))
    assert parts, "no unit finished within the deadline"
    finished = [json.loads(p.read_text())["train"]["file"] for p in parts]
    kept = {name: (out / name).stat().st_mtime_ns for name in finished}
    damaged = out / finished[0]
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")  # a finished shard damaged after the kill: redone
    lines = []
    index = tokenize(Settings(data=str(src), shard_tokens=8000), out, workers=1, progress=False, echo=lines.append)
    assert any("already tokenized and checked" in line for line in lines)
    clean = tokenize(Settings(data=str(src), shard_tokens=8000), tmp_path / "clean", workers=1, progress=False)
    assert index["splits"] == clean["splits"]
    rewritten = {name for name in kept if (out / name).stat().st_mtime_ns != kept[name]}
    assert rewritten == {damaged.name}  # every other finished shard was kept as it was


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its new parent to collect it does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_run_directory_lends_its_tokenizer(source, tmp_path):
    """`tokenize --tokenizer RUN` shards with the BPE a run trained on, and a run directory given to the library call
    without its tokenizer is refused."""
    import torch

    from hybrid_attention.cli import main
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM
    from hybrid_attention.training.model_run import save_model_run

    root, docs = source
    bpe = BPETokenizer.train([t for name in sorted(docs) for _, t in docs[name]], 280)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", vocab_size=bpe.vocab_size))
    run = save_model_run(tmp_path / "run", model, bpe)
    assert main(["tokenize", "--data", str(root), "--tokenizer", str(run), "--out", str(tmp_path / "o")]) == 0
    assert read_index(tmp_path / "o")["tokenizer"]["vocab_size"] == bpe.vocab_size
    assert np.array_equal(_stream(tmp_path / "o", "val")[0], _expected(docs, bpe, "val")[0])
    with pytest.raises(ValueError, match="is a run directory"):
        tokenize(Settings(data=str(root), tokenizer=str(run)), tmp_path / "p", workers=1, progress=False)
