"""`hybrid-attention synth` on a tiny grid, and `benchmarks/ablations.py --quick`, end to end in subprocesses; the
synth command's refusals of bad arguments."""

import json
import subprocess
import sys

from hybrid_attention import cli
from tests.helpers import REPO_ROOT, checkout_env

ROOT = REPO_ROOT
ENV = checkout_env()


def _run(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def test_synth_tiny_grid_logs_plots_and_resumes(tmp_path):
    grid = ["--grid", "mqar,palindrome/16/mla,gdn/3", "--lrs", "1e-3,3e-3"]
    size = ["--batch-size", "4", "--head-dim", "16", "--eval-batches", "1", "--device", "cpu", "--out", "out"]
    args = ["-m", "hybrid_attention.synth", *grid, *size]
    done = _run(args, tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(r["task"], r["model"]) for r in summary["best"]} == {
        (t, m) for t in ("mqar", "palindrome") for m in ("mla", "gdn")
    }
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["steps"] == 3 and r["optimizer"] == "adamw" for r in summary["best"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert sum(r.get("final", 0) for r in rows) == 8  # 2 tasks x 2 models x 2 learning rates
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 0
    again = _run(args, tmp_path)  # every run is finished: nothing trains again
    assert again.returncode == 0 and "8 already in" in again.stdout, again.stderr
    assert len((tmp_path / "out" / "log.jsonl").read_text().splitlines()) == len(rows)
    other = _run([*args, "--seed", "1", "--mqar-queries", "1"], tmp_path)  # other settings: not the same runs
    assert other.returncode == 1 and "other settings (mqar_queries, seed)" in other.stderr, other.stderr
    assert len((tmp_path / "out" / "log.jsonl").read_text().splitlines()) == len(rows)


def test_synth_rejects_a_bad_grid(tmp_path, monkeypatch, capsys):
    """The refusals, through the CLI's `main` in this process (the `-m` entry point runs above): each exits with
    its code and message before anything is written."""
    monkeypatch.chdir(tmp_path)

    def synth(*args):
        try:
            code = cli.main(["synth", *args])
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code
        return code, capsys.readouterr().err

    code, err = synth("--grid", "mqar/32/transformer", "--device", "cpu")
    assert code == 1 and "unknown model 'transformer'" in err
    code, err = synth("--grid", "stack/64/mla;mqar/32/mla", "--mqar-queries", "5", "--device", "cpu", "--out", "out")
    assert code == 1 and "queries must be an integer in [1, 4]" in err
    assert not (tmp_path / "out").exists()  # refused before the first run
    args = ["--grid", "stack/64/mla;mqar/32,64/mla", "--mqar-pairs", "16", "--device", "cpu", "--out", "out"]
    code, err = synth(*args)
    assert code == 1 and "mqar at seq_len 32: pairs must be an integer in [2, 15]" in err
    assert not (tmp_path / "out").exists()
    code, err = synth("--seed", str(2**64), "--device", "cpu", "--out", "out")
    assert code == 2 and "argument --seed: expected a value" in err, err
    assert not (tmp_path / "out").exists()
    code, err = synth("--cuda-graph", "--device", "cpu", "--out", "out")
    assert code == 1 and "--cuda-graph needs a CUDA device" in err, err
    assert not (tmp_path / "out").exists()


def test_ablations_quick(tmp_path):
    script = str(ROOT / "benchmarks" / "ablations.py")
    done = _run([script, "--quick", "--variants", "hybrid,mla-no-gate", "--eval-every", "2", "--out", "abl"], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["variant"] for r in result["results"]] == ["hybrid", "mla-no-gate"]
    assert all(r["val_loss"] > 0 and r["val_bpb"] > 0 and r["curve"] for r in result["results"])
    assert "| mla-no-gate | 0 |" in done.stdout
    saved = json.loads((tmp_path / "abl" / "mla-no-gate-seed0" / "config.json").read_text())
    assert saved["model"]["mla_output_gate"] is False
    assert saved["train"]["eval_every"] == 2
