"""Training on shards: `--doc-mask` (PackedRows, evaluate), `--report-to tensorboard`, a damaged shard refused before
anything is written, and a run saved before shards resuming on its own tokens (training/loop.py, packed_rows.py,
reporting.py, data/training_data.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybrid_attention.cli import main as cli_main
from hybrid_attention.config import HybridConfig
from hybrid_attention.data.tokenize_corpus import Settings, tokenize
from hybrid_attention.data.training_data import open_training_data
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import run_config
from hybrid_attention.runs.rundir import data_fingerprint
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.loop import train
from hybrid_attention.training.metrics import evaluate
from hybrid_attention.training.packed_rows import PackedRows
from hybrid_attention.training.reporting import TENSORBOARD_DIR, scalars

SMALL = dict(steps=2, batch_size=2, seq_len=48, eval_every=1, eval_batches=1, log_every=1, device="cpu")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder of shards of short documents (most windows of 48 tokens hold several)."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(600):
            f.write(
                json.dumps({"text": " ".join(rng.choice(["def", "x", "=", "1", "\n"], int(rng.integers(3, 12))))})
                + "\n"
            )
    out = root / "shards"
    tokenize(Settings(data=str(root / "docs.jsonl")), out, workers=1, progress=False)
    return out


def _tiny_model():
    torch.manual_seed(0)
    return HybridLM(HybridConfig.from_preset("tiny", residual="standard"))


def test_packed_rows_loss_skips_predictions_across_documents(shards):
    data = open_training_data(str(shards))
    model = _tiny_model()
    cuts = data.train.document_starts(0, 400)
    offsets = np.array([cuts[0] - 3, cuts[-1] - 20])  # windows of 24 tokens across document ends
    ids = torch.from_numpy(data.train.windows(offsets, 24))
    starts = [data.train.document_starts(int(s), 24) for s in offsets]
    assert all(len(s) > 0 for s in starts)
    loss = PackedRows(model)(ids, labels=ids, doc_starts=starts, return_logits=False).loss
    total, count = 0.0, 0
    for row, cut in zip(ids, starts, strict=True):
        bounds = [0, *cut.tolist(), 24]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            doc = row[a:b].unsqueeze(0)
            if b - a > 1:
                total, count = total + model(doc, labels=doc).loss * (b - a - 1), count + (b - a - 1)
    assert abs(loss.item() - total.item() / count) < 1e-5
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    byte_lengths = data.tokenizer.byte_lengths()
    masked, _ = evaluate(
        PackedRows(model),
        data.val,
        byte_lengths,
        batch_size=2,
        seq_len=48,
        num_batches=1,
        autocast=autocast,
        documents=True,
    )
    plain, _ = evaluate(
        PackedRows(model), data.val, byte_lengths, batch_size=2, seq_len=48, num_batches=1, autocast=autocast
    )
    assert np.isfinite(masked) and masked != plain


def test_doc_mask_run_with_tensorboard_then_a_resume_of_a_run_saved_before_shards(shards, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    config = TrainConfig.create(
        out=str(run), data=str(shards), doc_mask=True, report_to=("tensorboard",), stop_after=1, **SMALL
    )
    train(config, echo=lambda *a: None)
    events = event_accumulator.EventAccumulator(str(run / TENSORBOARD_DIR))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "val/loss",
        "val/bpb",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "memory/host_peak_gib",
    } <= tags
    assert events.Scalars("train/loss")[0].step == 1 and np.isfinite(events.Scalars("val/loss")[0].value)
    saved = run_config.load_config(run)
    assert saved["train"]["doc_mask"] is True and saved["data_fingerprint"]["format"] == "shards"
    # As a run saved before shards stores it: a sha256 over both splits as int32 ids.
    data = open_training_data(str(shards))
    legacy = data_fingerprint(
        *(torch.from_numpy(s.read(0, s.num_tokens).astype(np.int32)) for s in (data.train, data.val))
    )
    run_config.save_config(run, {k: v for k, v in {**saved, "data_fingerprint": legacy}.items() if k != "format"})
    summary = train(TrainConfig.create(saved["train"], out=str(run)), resume=True, echo=lambda *a: None)
    assert summary["step"] == 2 and [r["step"] for r in ckpt.read_log(run)] == [1, 2]
    run_config.save_config(
        run, {**{k: v for k, v in saved.items() if k != "format"}, "data_fingerprint": {**legacy, "sha256": "0" * 64}}
    )
    with pytest.raises(ValueError, match="the data changed since the run started"):
        train(TrainConfig.create(saved["train"], out=str(run), steps=2), resume=True, echo=lambda *a: None)


def test_a_damaged_shard_stops_the_run_before_anything_is_written(shards, tmp_path, capsys):
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    shard = next(copy.glob("train-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    argv = ["train", "--data", str(copy), "--out", str(tmp_path / "run"), "--steps", "1", "--device", "cpu"]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert f"{shard} is damaged" in err and "nothing was trained on it" in err
    assert not (tmp_path / "run").exists()


def test_scalars_carry_mfu_and_memory():
    row = {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "val_loss": None}
    values = scalars(row, device=torch.device("cpu"), flops_per_token=1e6, peak_flops=1e12)
    assert values["perf/mfu"] == pytest.approx(1e-4) and values["memory/host_peak_gib"] > 0
    assert "val/loss" not in values and values["train/loss"] == 2.0


def test_record_files_are_read_by_tokenize_not_as_one_text(shards, tmp_path):
    records = shards.parent / "docs.jsonl"
    with pytest.raises(ValueError, match="holds records, which `tokenize` reads"):
        open_training_data(str(records))
