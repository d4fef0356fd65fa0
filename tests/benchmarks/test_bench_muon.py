"""benchmarks/bench_muon.py --count-only runs anywhere: the operators of one Muon step at k3-scaled's matrices."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_muon

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def test_count_only_compares_the_two_optimizers(capsys):
    result = bench_muon.main(["--count-only"])
    rows = {r["optimizer"]: r for r in result["results"]}
    single, stacked = rows["torch.optim.Muon"], rows["StackedMuon"]
    assert single["matrices"] == stacked["matrices"] > 100
    # torch's: at least the 15 products of five iterations per matrix; ours: a few per shape.
    assert single["operators"] >= 15 * single["matrices"] and stacked["operators"] * 10 < single["operators"]
    assert "| StackedMuon | 148 |" in capsys.readouterr().out
