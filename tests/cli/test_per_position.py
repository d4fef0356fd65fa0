"""`hybrid-attention eval --per-position`: the table, the JSON line whose buckets average back to the plain eval's
loss on the same windows, the plot, and the flags it refuses."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from hybrid_attention import cli
from tests.helpers import run_cli

FAST = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--data-max-bytes", "40000", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("per-position") / "run"
    assert cli.main(["train", "--out", str(out), *FAST]) == 0
    return out


def test_table_json_and_plot(run_dir, tmp_path, capsys):
    plot = tmp_path / "position.png"
    code, out, err = run_cli(["eval", "--ckpt", run_dir, "--seq-len", 128, "--per-position", "--plot", plot], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    assert lines[0].startswith("| positions |") and f"wrote {plot}" in out
    assert "4 x the --seq-len 32" in err
    rows = result["buckets"]
    assert [(r["start"], r["stop"]) for r in rows] == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128)]
    assert [r["past_training"] for r in rows] == ["no"] * 5 + ["yes"] * 2
    assert sum(r["tokens"] for r in rows) == result["windows"] * 127 and result["train_seq_len"] == 32
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The plain eval of the same windows: the buckets weighted by their predictions give its loss.
    code, plain, _ = run_cli(["eval", "--ckpt", run_dir, "--seq-len", 128], capsys)
    assert code == 0
    loss = float(plain.split("loss ")[1].split(" nats")[0])
    weighted = sum(r["loss"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    assert abs(weighted - loss) < 1e-4 and abs(result["loss"] - loss) < 1e-4


def test_equal_buckets(run_dir, capsys):
    argv = ["eval", "--ckpt", run_dir, "--seq-len", 64, "--per-position", "--buckets", 3, "--max-batches", 1]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    rows = json.loads(out.strip().splitlines()[-1])["buckets"]
    assert [(r["start"], r["stop"]) for r in rows] == [(1, 22), (22, 43), (43, 64)]
    assert [r["past_training"] for r in rows] == ["no", "partly", "yes"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--buckets", "4"], "--buckets needs --per-position"),
        (["--plot", "{tmp}/p.png"], "--plot needs --per-position"),
        (["--per-position", "--plot", "{tmp}/p.txt"], "expected a file name ending in one of .png, .pdf, .svg"),
        (["--per-position", "--plot", "{tmp}/none/p.png"], "does not exist"),
        (["--per-position", "--seq-len", "16", "--buckets", "16"], "--buckets 16: a window of 16 tokens predicts 15"),
        (["--per-position", "--buckets", "0"], "argument --buckets: expected a value >= 1"),
    ],
)
def test_bad_flags(run_dir, tmp_path, capsys, extra, message):
    argv = ["eval", "--ckpt", run_dir, *[a.format(tmp=tmp_path) for a in extra]]
    code, _, err = run_cli(argv, capsys)
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err and message in err, err


def test_a_run_trained_on_separate_documents_is_refused(run_dir, tmp_path, capsys):
    copy = tmp_path / "docs"
    shutil.copytree(run_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["train"]["doc_mask"] = True
    (copy / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(["eval", "--ckpt", copy, "--per-position"], capsys)
    assert code == 1 and "trained with --doc-mask" in err, err
