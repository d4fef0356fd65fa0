"""The `hybrid-attention` command: train, generate, eval, info, bad input, and the README quick start."""

from __future__ import annotations

import io
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_attention import cli, machine
from hybrid_attention.cli import command
from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.generate import generate
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint
from hybrid_attention.runs.checkpoint import load_run
from hybrid_attention.training.config import TrainConfig
from tests.helpers import REPO_ROOT, run_cli

REPO = REPO_ROOT
FAST = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--data-max-bytes", "40000", "--eval-batches", "2"]


def snapshot(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert cli.main(["train", "--out", str(out), *FAST]) == 0
    return out


def test_defaults_and_presets():
    config = TrainConfig.create()
    assert (config.preset, config.tokenizer, config.optimizer, config.out) == ("tiny", None, "adamw", "runs/tiny")
    assert (config.steps, config.batch_size, config.seq_len, config.device) == (250, 8, 128, "auto")
    args = cli.build_parser().parse_args(["train"])
    assert all(getattr(args, name) is None for name in ("steps", "lr", "data", "out", "compile", "preset"))
    assert TrainConfig.create(preset="k3-scaled").seq_len == 2048


def test_train_output_and_files(run_dir):
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.json", "checkpoints", "log.jsonl", "loss.png", "summary.json"} <= names
    step = run_dir / "checkpoints" / "step_00000003"
    assert {p.name for p in step.iterdir()} == {"checkpoint.json", "model.safetensors", "train_state.pt"}
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and "val_loss" in rows[-1]


def test_train_prints_validation_loss_and_unigram_baseline(tmp_path, capsys):
    code, out, err = run_cli(["train", "--out", tmp_path / "r", *FAST], capsys)
    assert code == 0, err
    match = re.search(r"validation loss ([\d.]+) nats/token .* unigram baseline ([\d.]+) nats/token", out)
    assert match and all(math.isfinite(float(v)) for v in match.groups())


BAD_TRAIN = [
    (["--data", "{tmp}/missing.txt"], "no such file or directory"),
    (["--data", "{tmp}/empty.txt"], "holds no text"),
    (["--steps", "0"], "argument --steps: expected a value >= 1, got 0"),
    (["--lr", "-1"], "argument --lr: expected a value > 0.0"),
    (["--lr", "nan"], "argument --lr: expected a finite value > 0.0"),
    (["--batch-size", "two"], "argument --batch-size: expected an integer, got 'two'"),
    (["--preset", "huge"], "argument --preset: invalid choice"),
    (["--steps", "5", "--warmup", "9"], "--warmup must be between 0 and --steps (5), got 9"),
    (["--vocab-size", "300"], "--vocab-size 300 needs --tokenizer bpe"),
    (["--tokenizer", "bpe", "--vocab-size", "100"], "at least 256"),
    (["--stop-after", "9", "--steps", "5"], "--stop-after must be between 1 and --steps (5)"),
    (["--resume"], "no such run directory"),
    (["--seq-len", "100000"], "fewer than --seq-len 100000"),
    (["--out", ""], "--out must name a run directory, got an empty string"),
    (["--seed", str(2**70)], "argument --seed: expected a value >= 0 and <= 9223372036854775807"),
    (["--tokenizer", "bpe", "--vocab-size", "1000000000"], "--vocab-size must be at most 1,048,576"),
    (["--data", "/dev/null"], "/dev/null is neither a regular file nor a directory"),
    (["--device", "cpu", "--dtype", "bfloat16"], "--dtype bfloat16 is for CUDA devices; on the CPU use"),
]


@pytest.mark.parametrize("flags, message", BAD_TRAIN, ids=[" ".join(f) for f, _ in BAD_TRAIN])
def test_bad_train_input_is_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "out"
    flags = [f.format(tmp=tmp_path) for f in flags]
    code, _, err = run_cli(["train", "--out", out, *FAST, *flags], capsys)
    assert code != 0
    assert err.count("\n") == 1 and "Traceback" not in err and message in err, err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tmp_path, capsys):
    code, _, err = run_cli(["train", "--out", tmp_path / "o", "--device", "cuda", *FAST], capsys)
    assert code == 1 and err.count("\n") == 1 and "no CUDA device" in err and not (tmp_path / "o").exists()


def test_muon_missing_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    code, _, err = run_cli(["train", "--out", tmp_path / "o", "--optimizer", "muon", *FAST], capsys)
    assert code == 1 and err.count("\n") == 1 and "needs torch.optim.Muon" in err and not (tmp_path / "o").exists()


def test_occupied_run_directory_is_left_alone(run_dir, capsys):
    before = snapshot(run_dir)
    code, _, err = run_cli(["train", "--out", run_dir, *FAST, "--steps", "4"], capsys)
    assert code == 1 and "already holds a run; pass --resume" in err and err.count("\n") == 1
    code, _, err = run_cli(["train", "--out", run_dir, "--resume", "--lr", "0.5"], capsys)
    assert code == 1 and "--lr 0.5 (the run has 0.003)" in err and err.count("\n") == 1
    assert snapshot(run_dir) == before


def test_mismatched_checkpoint_is_refused(run_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["hidden_size"] = 48
    (bad / "config.json").write_text(json.dumps(config))
    before = snapshot(bad)
    for argv in (
        ["generate", "--ckpt", bad, "--prompt", "x"],
        ["eval", "--ckpt", bad],
        ["train", "--resume", "--out", bad],
    ):
        code, _, err = run_cli(argv, capsys)
        assert code == 1 and err.count("\n") == 1 and "does not match the model in config.json" in err, err
    assert snapshot(bad) == before
    (bad / "config.json").write_text("{not json")
    code, _, err = run_cli(["generate", "--ckpt", bad, "--prompt", "x"], capsys)
    assert code == 1 and "is not valid JSON" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--ckpt", "{tmp}/none", "--prompt", "x"], "no such run directory"),
        (["generate", "--ckpt", "{run}", "--prompt", ""], "the prompt is empty"),
        (["generate", "--ckpt", "{run}", "--top-p", "1.5"], "argument --top-p: expected a value > 0.0 and <= 1.0"),
        (["generate", "--ckpt", "{run}", "--temperature", "-1"], "argument --temperature"),
        (["eval", "--ckpt", "{tmp}"], "config.json is missing"),
        (["eval", "--ckpt", "{run}", "--data", "{tmp}/nothing"], "no such file or directory"),
        (["info", "--preset", "tiny", "--ckpt", "{run}"], "not allowed with argument --preset"),
        (["eval", "--ckpt", "{run}", "--seq-len", "1"], "argument --seq-len: expected a value >= 2, got 1"),
        (["generate", "--ckpt", "{run}", "--prompt", "ab\udcff"], "--prompt is not UTF-8 text"),
        (["generate", "--ckpt", "{run}", "--prompt", "x", "--seed", str(2**64)], "argument --seed: expected a value"),
        (["generate", "--ckpt", "{run}", "--prompt", "x", "--device", "cpu", "--dtype", "bfloat16"], "is for CUDA"),
    ],
)
def test_bad_generate_eval_info_input(run_dir, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in argv]
    code, _, err = run_cli(argv, capsys)
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err and message in err, err


def test_out_of_memory_is_one_line_and_leaves_the_directory_reusable(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine, "memory_bytes", lambda device: 10**30)  # past the bound: the allocator's own error
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--out", out, *FAST, "--batch-size", 10**12, "--eval-batches", 1], capsys)
    error = err.split("\n")[-2]  # the line after the progress bar
    assert code == 1 and "Traceback" not in err, err
    assert error.startswith("hybrid-attention train: error: out of memory (") and "try a smaller --batch-size" in error
    assert not checkpoint.holds_run(out)  # a plain re-run may use the directory


def test_out_of_memory_in_every_command_has_advice(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine, "memory_bytes", lambda device: 10**30)
    argv = ["synth", "--grid", "mqar/8/kda/1", "--batch-size", 10**12, "--out", tmp_path / "s", "--device", "cpu"]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    error = err.strip().split("\n")[-1]
    assert error.startswith("hybrid-attention synth: error: out of memory (") and "--batch-size" in error, err
    assert set(command._MEMORY_ADVICE) == set(cli.build_parser()._subparsers._group_actions[0].choices)


def test_non_utf8_prompt_on_stdin_is_one_line(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff")))
    code, _, err = run_cli(["generate", "--ckpt", run_dir], capsys)
    assert code == 1 and err.count("\n") == 1 and "the prompt on stdin is not UTF-8 (byte 0xff at 3)" in err, err


def test_a_tiny_temperature_samples_the_most_likely_token(run_dir, capsys):
    argv = ["generate", "--ckpt", run_dir, "--prompt", "def ", "--max-new-tokens", 6, "--temperature"]
    code, tiny, err = run_cli([*argv, "1e-45"], capsys)
    assert code == 0, err
    assert tiny == run_cli([*argv, "0"], capsys)[1]


def test_generate_streams_the_same_tokens_as_model_generate(run_dir, capsys):
    code, out, err = run_cli(
        ["generate", "--ckpt", run_dir, "--prompt", "def ", "--max-new-tokens", 24, "--seed", 5], capsys
    )
    assert code == 0, err
    model, _, tokenizer = load_run(run_dir)
    prompt = torch.tensor([tokenizer.encode("def ")])
    generator = torch.Generator().manual_seed(5)
    ids = generate(model, prompt, 24, temperature=0.8, generator=generator)
    assert out == "def " + tokenizer.decode(ids[0, 4:].tolist()) + "\n"
    match = re.search(r"24 tokens in .* then ([\d,.]+) tokens/s; cache ([\d,]+) bytes for 28 tokens", err)
    assert match, err
    assert int(match.group(2).replace(",", "")) == model.make_cache(1, 28).nbytes()


def test_generate_reads_the_prompt_from_stdin(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\n"))
    code, out, _ = run_cli(["generate", "--ckpt", run_dir, "--max-new-tokens", 5, "--temperature", 0], capsys)
    assert code == 0 and out.startswith("import os\n")
    greedy = out
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\n"))
    seeded = run_cli(["generate", "--ckpt", run_dir, "--max-new-tokens", 5, "--temperature", 0, "--seed", 9], capsys)
    assert seeded[1] == greedy  # greedy decoding does not depend on the sampling seed


def test_eval_reports_loss_and_bits_per_byte(run_dir, tmp_path, capsys):
    code, out, err = run_cli(["eval", "--ckpt", run_dir], capsys)
    assert code == 0, err
    loss, bpb = map(float, re.search(r"loss ([\d.]+) nats/token, ([\d.]+) bits/byte", out).groups())
    # Byte tokenizer: one byte per token, but the end of a document (byte 0xFF) stands for no text.
    assert loss / math.log(2) <= bpb < 1.01 * loss / math.log(2)
    text = tmp_path / "other.txt"
    text.write_text("".join(f"x = {i} * {i}\n" for i in range(800)))
    code, out, _ = run_cli(["eval", "--ckpt", run_dir, "--data", text, "--seq-len", 16], capsys)
    assert code == 0 and str(text) in out and "windows of 16" in out


def _info_numbers(out):
    rows = [tuple(line.split()) for line in out.splitlines() if re.fullmatch(r"\s*\d+\s+(kda|mla)\s+[\d,]+", line)]
    table = [{"index": int(i), "type": t, "parameters": int(p.replace(",", ""))} for i, t, p in rows]
    per_token = int(re.search(r"cache per token of context: ([\d,]+) bytes", out).group(1).replace(",", ""))
    state = int(re.search(r"constant state per sequence: ([\d,]+) bytes", out).group(1).replace(",", ""))
    total = int(re.search(r"parameters: ([\d,]+) total", out).group(1).replace(",", ""))
    return table, per_token, state, total


@pytest.mark.parametrize("source", ["tiny", "k3-scaled", "ckpt"])
def test_info_matches_the_model(run_dir, capsys, source):
    argv = ["info", "--ckpt", run_dir] if source == "ckpt" else ["info", "--preset", source]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    with torch.device("meta"):
        model = HybridLM(HybridConfig.from_preset("tiny" if source == "ckpt" else source))
    assert _info_numbers(out) == (
        model.layer_table(),
        model.cache_bytes_per_token(torch.bfloat16),
        model.state_bytes_per_sequence(torch.bfloat16),
        model.num_parameters(),
    )
    if source == "k3-scaled":
        assert [row["type"] for row in model.layer_table()] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"] + [
            "kda"
        ] * 3 + ["mla", "mla"]


def readme_quickstart() -> str:
    """The README's quick-start line: `pip install ... && hybrid-attention train && hybrid-attention generate ...`."""
    for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("pip install") and "hybrid-attention train" in line and "hybrid-attention generate" in line:
            return line
    raise AssertionError("README.md has no quick-start line (pip install ... && hybrid-attention train && ...)")


def test_readme_quickstart_command_runs(tmp_path):
    """The README's quick start without the install, through the console script, with a smaller budget."""
    line = readme_quickstart()
    command = line[line.index("hybrid-attention train") :]
    command = command.replace("hybrid-attention train", "hybrid-attention train " + shlex.join(FAST), 1)
    command = command.replace("hybrid-attention generate", "hybrid-attention generate --max-new-tokens 8", 1)
    assert shutil.which("hybrid-attention"), "the console script is not installed: pip install -e ."
    done = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "validation loss" in done.stdout and "unigram baseline" in done.stdout and "tokens/s" in done.stderr
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "latest").is_file()
    generated = done.stdout.split("\nrun directory: ", 1)[1].split("\n", 1)[1]  # what follows train's last line
    assert generated.startswith(shlex.split(command)[-1]) and generated.endswith("\n")


def test_python_dash_m_is_the_same_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_attention", "info", "--preset", "tiny"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "cache per token of context" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_attention", "train", "--steps", "x"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_bpe_run_trains_saves_and_reloads_its_tokenizer(tmp_path, capsys):
    run = tmp_path / "bpe"
    argv = ["train", "--out", run, *FAST, "--tokenizer", "bpe", "--vocab-size", 320, "--stop-after", 2]
    assert run_cli(argv, capsys)[0] == 0
    config = json.loads((run / "config.json").read_text())
    assert config["tokenizer"] == {"kind": "bpe", "vocab_size": 320, "file": "tokenizer.json", "eod_id": 0}
    assert config["model"]["vocab_size"] == 320
    saved = (run / "tokenizer.json").read_bytes()
    assert run_cli(["train", "--out", run, "--resume"], capsys)[0] == 0
    assert (run / "tokenizer.json").read_bytes() == saved  # reused, not retrained
    code, out, err = run_cli(["eval", "--ckpt", run], capsys)
    loss, bpb = map(float, re.search(r"loss ([\d.]+) nats/token, ([\d.]+) bits/byte", out).groups())
    assert code == 0 and bpb < loss / math.log(2) / 1.2  # several bytes per BPE token
    code, out, err = run_cli(["generate", "--ckpt", run, "--prompt", "import os", "--max-new-tokens", 6], capsys)
    assert code == 0 and out.startswith("import os") and "6 tokens in" in err


# ------------------------------------------------------------------------- the same mistakes through the Python API
def _tiny_model():
    torch.manual_seed(0)
    return HybridLM(HybridConfig.from_preset("tiny"))


def test_loss_without_labelled_positions_is_zero_not_nan():
    model = _tiny_model()
    ids = torch.randint(0, 256, (2, 9))
    for labels, input_ids in ((torch.full_like(ids, -100), ids), (ids[:, :1], ids[:, :1])):  # all ignored; T = 1
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        assert loss.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
    labels = ids.clone()
    labels[0, 3:] = -100
    logits = model(ids).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    assert torch.allclose(model(ids, labels=labels).loss, reference, rtol=1e-6, atol=0)


def test_token_ids_outside_the_vocabulary_are_a_clear_error():
    model = _tiny_model()
    for bad, seen in ((256, "[0, 256]"), (-1, "[-1, 5]")):
        ids = torch.tensor([[5, bad, 0]])
        with pytest.raises(ValueError, match=re.escape(f"token ids must be in [0, 256), got {seen}")):
            model(ids)
    assert HybridLM.check_token_ids is False  # on GPUs the check costs a sync per call, so it is opt-in there


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=1e-320), "temperature=1e-320"),
        (dict(top_k=2.5), "top_k=2.5; expected None or an integer >= 1"),
        (dict(top_p=float("nan")), "top_p=nan"),
        (dict(max_new_tokens=True), "max_new_tokens=True"),
    ],
)
def test_bad_generate_arguments_are_clear_errors(kwargs, message):
    model = _tiny_model()
    args = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(model, torch.tensor([[1, 2]]), **args)
    with pytest.raises(ValueError, match=r"make_cache: batch_size=1.5, max_seq_len=8; expected integers"):
        model.make_cache(1.5, 8)


def test_a_tiny_temperature_is_the_argmax():
    from hybrid_attention.inference.generate import sample_next_token

    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 5
    for temperature in (1e-45, 1e-300):
        assert torch.equal(sample_next_token(logits, temperature), logits.argmax(-1))
