"""benchmarks/serve_load.py's bookkeeping: length specs, percentiles, and a trial's summary and verdict."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve_load import Limits, Outcome, Trial, parse_lengths, percentile, summarize  # noqa: E402


def test_lengths_and_percentiles():
    import random

    rng = random.Random(0)
    assert parse_lengths("7")(rng) == 7 and {parse_lengths("2:4")(rng) for _ in range(100)} == {2, 3, 4}
    with pytest.raises(ValueError, match="LOW:HIGH"):
        parse_lengths("5:3")
    assert percentile([], 50) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_summary_holds_only_within_the_limits():
    fast = [Outcome(sent=0.0, first=0.5, last=0.9, prompt_tokens=4, completion_tokens=11) for _ in range(5)]
    row = summarize(Trial(2.0, fast, 2.0, [{"running_sequences": 3, "cache_pages_in_use": 2}]), Limits(), page_bytes=10)
    assert row["held"] and row["ttft_p99"] == pytest.approx(0.5) and row["tpot_p99"] == pytest.approx(0.04)
    assert row["output_tokens_per_s"] == pytest.approx(55 / 0.9) and row["cache_GB_max"] == 2e-8
    slow = fast[:4] + [Outcome(sent=0.0, first=2.5, last=3.0, completion_tokens=11)]
    assert not summarize(Trial(2.0, slow, 3.0), Limits())["held"]
    failed = fast[:4] + [Outcome(sent=0.0, error="HTTP 500")]
    row = summarize(Trial(2.0, failed, 2.0), Limits())
    assert not row["held"] and row["failed"] == 1


def test_a_broken_trial_names_the_request_the_limit_and_its_value():
    from serve_load import find_breach

    limits = Limits(ttft_s=2.0, tpot_s=0.05)
    done = [Outcome(sent=10.0 + i, first=10.1 + i, last=10.5 + i, completion_tokens=11, chunks=11) for i in range(3)]
    waiting = Outcome(sent=12.5)  # no first token 2.6 s after it was sent
    samples = [{"t": 14.0, "running_sequences": 7.0, "queue_depth": 2.0}, {"t": 11.0, "running_sequences": 1.0}]
    breach = find_breach([*done, waiting], limits, start=10.0, now=15.1, samples=samples)
    assert (breach.request, breach.limit, breach.tokens) == (3, "ttft", 0)
    assert breach.value == pytest.approx(2.6) and breach.sent_s == pytest.approx(2.5)
    text = breach.describe(limits)
    assert "request 3" in text and "TTFT limit: 2.600 s > 2 s" in text and "running_sequences 7" in text
    row = summarize(Trial(4.0, [*done, waiting], 5.1, samples, breach, 10.0), limits)
    assert not row["held"] and row["broke"] == text and row["in_flight"] == 1 and row["ttft_p99"] < 0.2
    slow = Outcome(sent=10.0, first=10.1, last=11.1, completion_tokens=11)  # 0.1 s per token after the first
    assert find_breach([slow], limits, 10.0, 12.0, []).limit == "tpot"
    failed = Outcome(sent=10.0, error="HTTP 500: boom")
    assert "failed: HTTP 500" in find_breach([done[0], failed], limits, 10.0, 11.0, []).describe(limits)
    assert find_breach(done, limits, 10.0, 14.0, samples) is None
