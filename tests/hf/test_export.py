"""`hybrid-attention export --hf`: a trained run (byte and BPE tokenizers) as a transformers model directory that
AutoModelForCausalLM / AutoTokenizer load to the same logits, token ids and greedy text; bad targets and a missing
transformers are one-line errors."""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hybrid_attention.hf import HybridAttentionForCausalLM  # noqa: E402
from hybrid_attention.inference.generate import generate  # noqa: E402
from hybrid_attention.runs.checkpoint import load_run  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

FAST = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--data-max-bytes", "20000", "--eval-batches", "1"]
TEXT = "def f(x):\n    return x  # é 漢字 🙂\tend "


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_exported_run_loads_with_auto_classes(tmp_path, capsys, tokenizer):
    run, out = tmp_path / "run", tmp_path / "hf"
    extra = ["--tokenizer", "bpe", "--vocab-size", 300] if tokenizer == "bpe" else []
    assert run_cli(["train", "--out", run, *FAST, *extra], capsys)[0] == 0
    code, stdout, _ = run_cli(["export", "--ckpt", run, "--hf", out], capsys)
    assert code == 0 and f"wrote {out}" in stdout
    ours, _, ours_tok = load_run(run)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, HybridAttentionForCausalLM)
    inputs = tok(TEXT, return_tensors="pt")
    ids = inputs["input_ids"]
    assert ids[0].tolist() == ours_tok.encode(TEXT) and tok.padding_side == "left"
    assert tok.decode(ids[0]) == ours_tok.decode(ids[0].tolist()) == TEXT
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours(ids).logits)
    theirs = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(theirs, generate(ours, ids, 12, temperature=0))
    assert tok.decode(theirs[0]) == ours_tok.decode(theirs[0].tolist())


def test_export_refuses_an_occupied_directory_and_reports_missing_transformers(tmp_path, capsys, monkeypatch):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("keep me")
    code, _, err = run_cli(["export", "--ckpt", tmp_path / "no-run", "--hf", occupied], capsys)
    assert code == 1 and "already exists and is not an empty directory" in err and len(err.splitlines()) == 1
    assert (occupied / "notes.txt").read_text() == "keep me"
    monkeypatch.setitem(sys.modules, "hybrid_attention.hf.export", None)  # import fails as without transformers
    code, _, err = run_cli(["export", "--ckpt", tmp_path, "--hf", tmp_path / "new"], capsys)
    assert code == 1 and "needs the optional transformers package: pip install 'hybrid-attention[hf]'" in err
