"""Sizes a flag or a config.json asks for are bounded by what the machine and the run have: each absurd request is one
line at once (train, synth, eval, generate, info), generation stays within the context limit, and an allocator's
error is one line cut at a word."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from hybrid_attention import cli, machine
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from tests.helpers import run_cli

SMALL = ["--batch-size", 1, "--seq-len", 16, "--eval-batches", 1, "--log-every", 1]
GB = 10**9


def one_line(code: int, err: str, message: str) -> bool:
    return code == 1 and err.count("\n") == 1 and "Traceback" not in err and message in err


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "data.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300)))
    return path


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("limits") / "run"
    assert cli.main([str(a) for a in ["train", "--out", out, "--data", data, "--steps", 1, *SMALL]]) == 0
    return out


def test_training_sizes_beyond_the_machine_or_the_data_are_one_line(data, tmp_path, capsys):
    new = ["train", "--data", data, "--steps", 2]
    argv = [
        *new,
        "--out",
        tmp_path / "a",
        "--grad-accum",
        10**12,
        "--time-limit",
        0.01,
        "--batch-size",
        8,
        "--seq-len",
        16,
    ]
    code, _, err = run_cli(argv, capsys)
    assert one_line(code, err, "a step's 128,000,000,000,000 token ids (--grad-accum 1,000,000,000,000 x "), err
    assert "would need at least 1.02 PB, more than the" in err and not (tmp_path / "a").exists()
    code, _, err = run_cli([*new, "--out", tmp_path / "b", *SMALL, "--eval-batches", 10**9], capsys)
    assert one_line(code, err, "--eval-batches 1,000,000,000: 1,000,000,000 windows of 16 tokens, more than the"), err
    assert "distinct windows of the training split" in err and "pass at most" in err


def test_synth_lengths_beyond_the_machine_are_one_line(tmp_path, capsys):
    argv = ["synth", "--grid", "mqar/100000000/kda/1", "--out", tmp_path / "s", "--device", "cpu"]
    code, _, err = run_cli(argv, capsys)
    message = "a batch of 64 mqar sequences of 100,000,000 tokens (--grid, --batch-size) would need at least"
    assert one_line(code, err, message), err
    assert not (tmp_path / "s").exists()


def test_a_config_with_100000_layers_answers_at_once(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine, "memory_bytes", lambda device: 16 * GB)  # the same answer on any machine
    deep = tmp_path / "deep"
    shutil.copytree(run, deep)
    config = json.loads((deep / "config.json").read_text())
    config["model"]["layer_types"] = ["kda", "kda", "kda", "mla"] * 25_000
    (deep / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    code, out, err = run_cli(["info", "--ckpt", deep], capsys)
    assert code == 0 and "hidden 64, 100,000 layers" in out and "25,000 MLA layers" in out, err
    table = re.findall(r"^ *\d+  (?:kda|mla) ", out, flags=re.MULTILINE)
    assert len(table) == 100_000 and "\n100000  mla  " in out
    for argv in (["generate", "--ckpt", deep, "--prompt", "x"], ["eval", "--ckpt", deep]):
        code, _, err = run_cli(argv, capsys)
        assert one_line(code, err, f"loading the model of {deep} in float32 ("), err
        assert "parameters in 100,000 layers) would need at least" in err
    code, _, err = run_cli(["train", "--resume", "--out", deep], capsys)
    assert one_line(code, err, "training the model with adamw ("), err
    assert time.perf_counter() - start < 60


def test_generation_is_bounded_by_the_context(run, capsys):
    argv = ["generate", "--ckpt", run, "--prompt", "def ", "--max-new-tokens", 10**30, "--max-context", 12]
    code, out, err = run_cli(argv, capsys)
    note = "generate: note: --max-new-tokens 1,000,000,000,000,000,000,000,000,000,000 reaches past the context limit"
    assert code == 0 and note in err and "of 12 tokens (--max-context); generating at most 8 after" in err, err
    assert "[8 tokens in" in err and len(out.encode()) <= len("def \n") + 8 * 3  # 8 bytes, shown as text
    code, _, err = run_cli(["generate", "--ckpt", run, "--prompt", "x" * 300], capsys)
    limit = "the prompt is 300 tokens, more than the context limit of 256 (16 x the run's --seq-len 16)"
    assert one_line(code, err, limit), err


def test_a_long_prompt_shows_its_prefill_progress(run, capsys, monkeypatch):
    """A prefill that runs past the bar's delay shows it on stderr (the delay set to 0 stands for a long prompt)."""
    import hybrid_attention.inference.prefill as prefill

    monkeypatch.setattr(prefill, "PROGRESS_DELAY_S", 0.0)
    prompt = "x = 1\n" * 200  # 1,200 tokens
    argv = ["generate", "--ckpt", run, "--prompt", prompt, "--max-new-tokens", 1, "--max-context", 1300]
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "prefill: " in err and "1.20k/1.20k [" in err, err


def test_an_eval_batch_beyond_the_memory_is_one_line(run, capsys):
    code, _, err = run_cli(["eval", "--ckpt", run, "--batch-size", 10**12, "--max-batches", 1], capsys)
    assert one_line(code, err, "a batch's 16,000,000,000,000 token ids (--batch-size 1,000,000,000,000 x --seq-len 16)")


def test_a_cache_beyond_the_memory_is_refused_before_it_is_made():
    model = HybridLM(HybridConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=r"^a cache for 1 x 1,000,000,000,000,000,000,000,000,000,000 tokens would"):
        model.make_cache(1, 10**30)
    assert model.make_cache(2, 5).max_seq_len == 5


def test_an_allocators_error_is_one_line_cut_at_a_word(run, capsys, monkeypatch):
    words = " ".join(f"word{i}" for i in range(100))

    def fail(*args, **kwargs):
        raise RuntimeError(f"DefaultCPUAllocator: not enough memory: you tried to allocate 192 TB. {words}")

    monkeypatch.setattr("hybrid_attention.runs.checkpoint.load_run", fail)
    code, _, err = run_cli(["generate", "--ckpt", run, "--prompt", "x"], capsys)
    detail = err.split("out of memory (", 1)[1].rsplit(")", 1)[0]
    assert code == 1 and err.count("\n") == 1 and detail.endswith(" ...") and detail.startswith("DefaultCPUAllocator")
    assert detail.removesuffix(" ...").split(" ")[-1] in words.split(" ")  # a whole word before the cut
