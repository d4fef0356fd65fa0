"""Load generator for OpenAI-compatible completion servers (aiohttp): Poisson arrivals, streamed responses, time to
first token (TTFT) and time per output token (TPOT) per request, and the server's /metrics sampled while it runs.

A trial ends early once one request breaks a latency limit (its TTFT, or its TPOT at the end): the percentiles of a
trial of a few dozen requests are set by its worst ones, so the trial can no longer pass. The trial then names that
request, the limit and its value (`Breach`). Imported by bench_serve.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Limits:
    ttft_s: float = 2.0  # p99 of the time to the first token
    tpot_s: float = 0.05  # p99 of the time per output token after the first


@dataclass
class Outcome:
    """One request: when it was sent, when its first and last tokens arrived, its token counts (`chunks`: stream
    events with text received so far), or its error."""

    sent: float
    first: float | None = None
    last: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    chunks: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.completion_tokens < 2:
            return None
        return (self.last - self.first) / (self.completion_tokens - 1)


@dataclass
class Breach:
    """The first request that broke a limit: its number in arrival order, sent `sent_s` after the trial began,
    the limit ("ttft", "tpot" or "error"), its value in seconds (for a TTFT, how long it had waited without a first
    token, when none came), the tokens it had received, and the server's /metrics sample nearest that moment."""

    request: int
    limit: str
    value: float | None
    sent_s: float
    tokens: int
    server: dict = field(default_factory=dict)
    error: str | None = None

    def describe(self, limits: Limits) -> str:
        if self.limit == "error":
            return f"request {self.request} (sent at {self.sent_s:.2f} s) failed: {self.error}"
        bound = limits.ttft_s if self.limit == "ttft" else limits.tpot_s
        load = ", ".join(f"{k} {self.server[k]:g}" for k in ("running_sequences", "queue_depth") if k in self.server)
        return (
            f"request {self.request} (sent at {self.sent_s:.2f} s, {self.tokens} tokens received) broke the "
            f"{self.limit.upper()} limit: {self.value:.3f} s > {bound:g} s" + (f" (server: {load})" if load else "")
        )


@dataclass
class Trial:
    rate: float
    outcomes: list[Outcome]
    seconds: float
    samples: list[dict] = field(default_factory=list)  # /metrics values over time
    breach: Breach | None = None  # the request that broke a limit (the trial stopped there)
    start: float = 0.0  # perf_counter at the trial's start


def parse_lengths(spec: str):
    """ "4096" (fixed) or "3000:5000" (uniform, inclusive) -> a function of a random.Random giving a length."""
    low, _, high = spec.partition(":")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise ValueError(f"lengths {spec!r}: expected N or LOW:HIGH with 1 <= LOW <= HIGH")
    return lambda rng: rng.randint(low, high)


async def _stream(client, url: str, body: dict, outcome: Outcome, limits: Limits, broke: asyncio.Event) -> None:
    try:
        async with client.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = chunk["error"]["message"]
                    return
                now = time.perf_counter()
                if chunk.get("choices"):
                    outcome.first = outcome.first or now
                    outcome.last = now
                    outcome.chunks += 1
                if chunk.get("usage"):
                    outcome.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    outcome.completion_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if outcome.error or (outcome.tpot or 0) > limits.tpot_s:
        broke.set()


def find_breach(outcomes: list[Outcome], limits: Limits, start: float, now: float, samples: list[dict]):
    """The request that broke a limit first (an error, a TTFT over the limit or a wait for a first token that
    passed it, a TPOT over the limit), or None."""
    found = []
    for i, o in enumerate(outcomes):
        if o.error:
            found.append((o.last or now, Breach(i, "error", None, o.sent - start, o.chunks, error=o.error)))
        elif (o.first or now) - o.sent > limits.ttft_s:
            value = (o.first or now) - o.sent
            found.append((o.sent + limits.ttft_s, Breach(i, "ttft", value, o.sent - start, o.chunks)))
        elif (o.tpot or 0.0) > limits.tpot_s:
            found.append((o.last, Breach(i, "tpot", o.tpot, o.sent - start, o.chunks)))
    if not found:
        return None
    when, breach = min(found, key=lambda pair: pair[0])
    near = min(samples, key=lambda s: abs(s["t"] - when), default={})
    breach.server = {k: v for k, v in near.items() if k != "t"}
    return breach


async def _scrape(client, url: str, samples: list[dict], stop: asyncio.Event, every: float = 0.25) -> None:
    """/metrics every `every` seconds: every sample of a metric named hybrid_attention_* (labels dropped)."""
    while not stop.is_set():
        try:
            async with client.get(f"{url}/metrics") as response:
                text = await response.text()
            values = {"t": time.perf_counter()}
            for line in text.splitlines():
                if line.startswith("hybrid_attention_") and "{" not in line:
                    name, value = line.rsplit(" ", 1)
                    values[name.removeprefix("hybrid_attention_")] = float(value)
            samples.append(values)
        except aiohttp.ClientError:
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def run_trial(
    url: str,
    model: str,
    *,
    rate: float,
    num_requests: int,
    prompt_len,
    output_len,
    vocab: int,
    limits: Limits,
    seed: int = 0,
    stop_on_break: bool = True,
    scrape_every: float = 0.25,
) -> Trial:
    """Send `num_requests` streamed greedy requests of random token ids, arriving as a Poisson process of `rate`
    per second (inf: all at once); wait for them, or stop at the first broken limit when `stop_on_break`."""
    rng = random.Random(seed)
    outcomes, tasks, samples = [], [], []
    broke, stop = asyncio.Event(), asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        scraper = asyncio.ensure_future(_scrape(client, url, samples, stop, scrape_every))
        start = time.perf_counter()
        arrival = start
        for _ in range(num_requests):
            if math.isfinite(rate):
                arrival += rng.expovariate(rate)
            while (wait := arrival - time.perf_counter()) > 0 and not broke.is_set():
                await asyncio.sleep(min(wait, 0.05))
                _check_first_tokens(outcomes, limits, broke)
            if broke.is_set() and stop_on_break:
                break
            body = dict(
                prompt=[rng.randrange(vocab) for _ in range(prompt_len(rng))],
                max_tokens=output_len(rng),
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            if model:
                body["model"] = model
            outcome = Outcome(sent=time.perf_counter())
            outcomes.append(outcome)
            tasks.append(asyncio.ensure_future(_stream(client, url, body, outcome, limits, broke)))
        while not all(t.done() for t in tasks) and not (broke.is_set() and stop_on_break):
            await asyncio.wait(tasks, timeout=0.05)
            _check_first_tokens(outcomes, limits, broke)
        for task in tasks:  # closing a connection cancels its request on the server
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        seconds = time.perf_counter() - start
        stop.set()
        await scraper
    breach = find_breach(outcomes, limits, start, start + seconds, samples) if broke.is_set() else None
    return Trial(rate, outcomes, seconds, samples, breach, start)


def _check_first_tokens(outcomes: list[Outcome], limits: Limits, broke: asyncio.Event) -> None:
    now = time.perf_counter()
    if any((o.first or now) - o.sent > limits.ttft_s for o in outcomes):
        broke.set()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, None for no values."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(trial: Trial, limits: Limits, page_bytes: int | None = None) -> dict:
    """Throughput, latency percentiles and the server's load over a trial, and whether it held the limits."""
    done = [o for o in trial.outcomes if o.error is None and o.last is not None and o.completion_tokens]
    ttft = [o.ttft for o in done]
    tpot = [o.tpot for o in done if o.tpot is not None]
    span = (max(o.last for o in done) - min(o.sent for o in trial.outcomes)) if done else trial.seconds
    out_tokens = sum(o.completion_tokens for o in done)
    running = [s.get("running_sequences", 0) for s in trial.samples]
    pages = [s.get("cache_pages_in_use", 0) for s in trial.samples]
    row = dict(
        rate=trial.rate,
        requests=len(trial.outcomes),
        completed=len(done),
        failed=sum(o.error is not None for o in trial.outcomes),
        requests_per_s=len(done) / span if span > 0 else 0.0,
        output_tokens_per_s=out_tokens / span if span > 0 else 0.0,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        running_mean=statistics.fmean(running) if running else None,
        running_max=max(running, default=None),
        cache_pages_max=max(pages, default=None),
        in_flight=sum(o.error is None and o.first is None for o in trial.outcomes),
        broke=trial.breach.describe(limits) if trial.breach else None,
        breach=vars(trial.breach) if trial.breach else None,
    )
    if page_bytes and pages:
        row["cache_GB_max"] = max(pages) * page_bytes / 1e9
    row["held"] = (
        trial.breach is None
        and row["completed"] == row["requests"]
        and row["ttft_p99"] is not None
        and row["ttft_p99"] <= limits.ttft_s
        and (row["tpot_p99"] or 0.0) <= limits.tpot_s
    )
    return row
