"""The command line at pretraining sizes: `train --model-config FILE` and `info`'s FLOPs and training memory."""

from __future__ import annotations

import json

import pytest

from hybrid_attention.config import HybridConfig
from hybrid_attention.model_size import model_size
from hybrid_attention.training.memory import CARD_MEMORY, binary_size, largest_batch, training_memory, usable_bytes
from hybrid_attention.training.metrics import config_flops_per_token
from tests.helpers import run_cli

FAST = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--data-max-bytes", "20000", "--eval-batches", "1"]


def test_model_config_sets_fields_over_the_preset_and_is_saved(tmp_path, capsys):
    spec = tmp_path / "model.json"
    spec.write_text(json.dumps({"hidden_size": 32, "layer_types": ["kda", "mla"], "residual": "block_attnres"}))
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model-config", spec, "--out", out, *FAST, "--activation-checkpointing"], capsys)
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())
    expected = HybridConfig.from_preset("tiny", hidden_size=32, layer_types=("kda", "mla"), residual="block_attnres")
    assert saved["model"] == expected.to_dict()
    assert saved["train"]["activation_checkpointing"] == "all"
    code, _, err = run_cli(["train", "--resume", "--out", out, "--model-config", spec], capsys)
    assert code == 1 and "a resumed run keeps the one in its config.json" in err
    code, out_text, err = run_cli(["info", "--ckpt", out], capsys)
    assert code == 0 and "hidden 32, 2 layers" in out_text, err


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"hidden_size": 32, "heads": 4}', "unknown settings ['heads']"),
        ('{"hidden_size": "wide"}', 'hidden_size = "wide"; expected an integer'),
        ('{"layer_types": ["kda", "rnn"]}', "layer_types[1] = 'rnn'; expected one of ('kda', 'mla')"),
        ('{"vocab_size": 512}', "vocab_size is the tokenizer's"),
        ('{"num_layers": 4}', "unknown settings ['num_layers']"),
        ("[1, 2]", "expected a JSON object of model settings, got list"),
        ("{", "is not valid JSON"),
    ],
)
def test_a_bad_model_config_is_one_line_naming_the_file(tmp_path, capsys, text, message):
    spec = tmp_path / "model.json"
    spec.write_text(text)
    code, _, err = run_cli(["train", "--model-config", spec, "--out", tmp_path / "run"], capsys)
    assert code == 1 and f"--model-config {spec}" in err and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_info_gives_flops_and_the_memory_of_a_step_on_a_card(capsys):
    argv = [
        "info",
        "--preset",
        "k3-3b",
        "--batch-size",
        "4",
        "--seq-len",
        "2048",
        "--grad-accum",
        "2",
        "--card",
        "h100",
    ]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    config = HybridConfig.from_preset("k3-3b")
    size = model_size(config)
    flops = config_flops_per_token(config, size.parameters - size.embedding, 2048)
    assert f"training FLOPs per token at --seq-len 2,048: {flops:.3g}" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-4:]}
    usable = usable_bytes(CARD_MEMORY["h100"])
    for kind in ("none", "mixer", "mlp", "all"):
        m = training_memory(config, batch_size=4, seq_len=2048, grad_accum=2, checkpointing=kind)
        most = largest_batch(config, seq_len=2048, memory=usable, grad_accum=2, checkpointing=kind)
        assert " ".join(rows[kind][-4:]) == f"{binary_size(m.peak)} {'yes' if m.peak <= usable else 'no'} {most}"
    code, out, err = run_cli(["info", "--preset", "tiny"], capsys)
    assert code == 0 and "(--card h100|h200 or --device-memory GIB says whether a step fits a card)" in out
    code, _, err = run_cli(["info", "--card", "h100", "--device-memory", "80"], capsys)
    assert code == 2 and "not allowed with argument --card" in err
