"""The cases of benchmarks/bench_train.py at the pretraining sizes: peers sized like the preset, the `:fp8`,
`:ckpt-KIND` and `@MODE` variants, and a --quick run of them on the CPU."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from benchmarks.train_cases import MODES, Spec, make_cases, parse_spec
from hybrid_attention.config import HybridConfig
from tests.helpers import REPO_ROOT, checkout_env


def test_variants_parse_and_bad_ones_name_what_is_wrong():
    cases = make_cases({})
    assert parse_spec("ours-1b:fp8-rowwise:ckpt-mlp@graph", cases, MODES) == Spec(
        "ours-1b:fp8-rowwise:ckpt-mlp@graph", "ours-1b", "rowwise", "mlp", "graph"
    )
    assert parse_spec("ours-3b:fp8", cases, MODES) == Spec("ours-3b:fp8", "ours-3b", "tensorwise", "none", None)
    for text, message in [
        ("ours-2b", "unknown case 'ours-2b'"),
        ("ours-1b@fast", "mode 'fast'"),
        ("ours-1b:fp16", "unknown variant 'fp16'"),
        ("llama-1b:fp8", "apply to our models (ours-*) only"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_spec(text, cases, MODES)


def test_peers_have_the_presets_sizes():
    """Llama and FLA's KDA model at the preset's hidden size, depth, heads and FFN (checked on the meta device)."""
    import torch

    config = HybridConfig.from_preset("k3-1b")
    with torch.device("meta"):
        llama, _, _ = make_cases({})["llama-1b"].build()
    c = llama.config
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (
        config.hidden_size,
        config.num_layers,
        config.intermediate_size,
    )
    assert (c.num_attention_heads, c.head_dim, c.vocab_size) == (config.kda_num_heads, 128, config.vocab_size)


def test_quick_run_of_the_size_cases():
    cases = "ours-1b:ckpt-mlp,llama-1b@eager" + (",ours-1b:fp8" if importlib.util.find_spec("torchao") else "")
    cmd = [sys.executable, "benchmarks/bench_train.py", "--quick", "--cases", cases]
    cmd += ["--shapes", "1x16", "--steps", "1", "--warmup", "0", "--modes", "eager"]
    env = checkout_env()
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["results"]}
    assert sorted(rows) == sorted(cases.split(","))
    for name, row in rows.items():
        assert row["error"] is None and row["tokens_per_s"] > 0 and row["mode"] == "eager", (name, row)
    assert rows["ours-1b:ckpt-mlp"]["description"].endswith("--activation-checkpointing mlp")
