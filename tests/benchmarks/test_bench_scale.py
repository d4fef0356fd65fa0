"""bench_scale.py's table of thresholds from bench_train's and train's rows (the GPU figures made up here)."""

from __future__ import annotations

import pytest

from benchmarks.bench_scale import SPEED_CASES, speed_cases, thresholds


def _speed(tokens_per_s: dict[str, float], **extra) -> list[dict]:
    rows = [
        dict(case=c, error=None, tokens_per_s=tokens_per_s.get(c, 1.0), mfu=None, peak_gib=None) for c in SPEED_CASES
    ]
    for row in rows:
        row.update(extra.get(row["case"], {}))
    return rows


def test_each_threshold_reads_its_rows():
    speed = _speed(
        {
            "ours-1b@graph": 140,
            "ours-1b-standard@graph": 145,
            "llama-1b@eager": 90,
            "llama-1b@compile": 100,
            "fla-1b@graph": 120,
            "ours-1b@compile": 130,
            "ours-1b:fp8@compile": 170,
        },
        **{
            "ours-1b@graph": dict(mfu=0.41, peak_gib=30.0),
            "llama-1b@compile": dict(peak_gib=35.0),
            "fla-1b@graph": dict(peak_gib=29.0),
            "ours-3b:ckpt-mixer@graph": dict(peak_gib=70.0),
        },
    )
    loss = [
        dict(run="bf16", steps=300, val_loss=2.0, error=None),
        dict(run="fp8", steps=300, val_loss=2.03, error=None),
    ]
    rows = {measure: (measured, met) for measure, _, measured, met in thresholds(speed, loss)}
    assert rows["k3-1b MFU, bf16"] == ("41.0%", "yes")
    assert rows["k3-1b tokens/s over Llama-SDPA (best mode)"] == ("1.40x", "yes")  # against its compiled row
    assert rows["k3-1b tokens/s over FLA KDA"] == ("1.17x", "no")
    assert rows["k3-1b peak memory against FLA KDA"] == ("30.0 vs 29.0 GiB", "no")
    assert rows["Block AttnRes overhead at k3-1b"] == ("+3.6%", "yes")
    assert rows["--fp8 tokens/s over bf16, compiled"] == ("1.31x", "yes")
    assert rows["k3-3b at 4 x 2048, --activation-checkpointing mixer"] == ("70.0 GiB", "yes")
    assert rows["--fp8 loss after 300 steps"] == ("2.0300 vs 2.0000 (+1.50%)", "no")
    failed = [dict(r, error="OutOfMemoryError") if r["case"].startswith("ours-3b") else r for r in speed]
    rows = {measure: (measured, met) for measure, _, measured, met in thresholds(failed, [])}
    assert rows["k3-3b at 4 x 2048, --activation-checkpointing mixer"] == ("-", "-")


def test_cases_choose_part_of_the_speed_part():
    assert speed_cases(None, quick=False) == list(SPEED_CASES)
    assert speed_cases("fla-1b@graph, ours-1b@graph", quick=False) == ["fla-1b@graph", "ours-1b@graph"]
    assert speed_cases("ours-1b", quick=True) == ["ours-1b"]
    for bad, quick in (("ours-1b", False), ("fla-1b@graph", True), (",", False)):
        with pytest.raises(ValueError, match="--cases: .*expected some of"):
            speed_cases(bad, quick=quick)


def test_speed_part_passes_the_step_settings_to_bench_train(monkeypatch):
    import argparse

    from benchmarks import bench_scale

    seen = []
    monkeypatch.setattr(bench_scale.bench_train, "main", lambda argv: seen.append(argv) or {"results": []})
    args = argparse.Namespace(cases="ours-1b", quick=True, shape="2x32", steps=2, warmup=1, grad_accum=2, profile=True)
    assert bench_scale.speed(args) == []
    (argv,) = seen
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert flags["--grad-accum"] == "2" and flags["--shapes"] == "2x32" and flags["--cases"] == "ours-1b", argv
    assert argv[argv.index("--profile") + 1 : argv.index("--profile") + 3] == ["--profile-top", "25"], argv
    args.profile = False
    bench_scale.speed(args)
    assert "--profile" not in seen[-1], seen[-1]
