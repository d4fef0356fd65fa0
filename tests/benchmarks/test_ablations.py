"""benchmarks/ablations.py --per-position on the CPU: each run evaluated by `hybrid-attention eval --per-position` in
a process of its own, its log and JSON kept in the run directory and read back on a rerun; the extrapolation group;
a run stopped by --time-budget continuing on a rerun."""

from __future__ import annotations

import json
import math

from benchmarks import ablations
from hybrid_attention.runs import checkpoint


def test_extrapolation_group():
    args = ablations.parse_args(["--variants", "extrapolation"])
    assert args.variants == ["hybrid", "all-kda", "all-mla", "all-mla-rope"]
    assert ablations.variants(4)["all-mla-rope"] == {"layer_types": ["mla"] * 4, "mla_rope": True}


def test_per_position_keeps_each_evaluation(tmp_path, capsys):
    argv = ["--quick", "--variants", "all-mla-rope", "--per-position", "--position-factors", "2", "--out", tmp_path]
    assert ablations.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "all-mla-rope-seed0"
    log = (run / "per-position-64.log").read_text()
    assert "eval --ckpt" in log and "| positions |" in log  # the command, then its output
    saved = json.loads((run / "per-position-64.json").read_text())
    assert saved["seq_len"] == 64 and saved["train_seq_len"] == 32 and saved["windows"] == 8
    assert "windows of 64 tokens, trained at 32" in out and "| all-mla-rope | 0 |" in out
    assert (tmp_path / "per_position.png").is_file() and (run / "per-position-64.png").is_file()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["results"][0]["per_position"]["64"] == saved
    (run / "per-position-64.log").unlink()  # a rerun reads the kept JSON back instead of evaluating again
    assert ablations.main([str(a) for a in argv]) == 0
    assert not (run / "per-position-64.log").exists()


def test_a_run_stopped_by_the_time_budget_continues_on_a_rerun(tmp_path, capsys, monkeypatch):
    argv = ["--quick", "--variants", "all-mla", "--out", str(tmp_path)]
    monkeypatch.setattr(ablations, "minutes_left", lambda args: 1e-6)  # the budget ends after the first step
    assert ablations.main(argv) == 0
    run = tmp_path / "all-mla-seed0"
    stopped = json.loads((run / "summary.json").read_text())
    assert stopped["step"] < stopped["steps"] == 3
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"] == []
    monkeypatch.setattr(ablations, "minutes_left", lambda args: None)
    assert ablations.main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert result["step"] == result["steps"] == 3 and math.isfinite(result["val_loss"])
    steps = [r["step"] for r in checkpoint.read_log(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 3  # the log continued from the checkpoint, no step twice
