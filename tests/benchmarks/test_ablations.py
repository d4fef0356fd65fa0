"""benchmarks/ablations.py --per-position on the CPU: each run evaluated by `hybrid-attention eval --per-position` in
a process of its own, its log and JSON kept in the run directory and read back on a rerun; the extrapolation group."""

from __future__ import annotations

import json

from benchmarks import ablations


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
