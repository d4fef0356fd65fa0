"""Where the serving engine's time goes, without HTTP: time to the first token of a lone long prompt (prefilled in
the engine's idle chunks), the same prompt joining sequences that decode (prefilled in chunks under
--max-batched-tokens, mixed with their decode steps), and the kernels and host functions of one mixed iteration.

    python benchmarks/profile_serve.py [--preset k3-scaled] [--prompts 32K,128K] [--decoding 8]
                                       [--max-batched-tokens N] [--top 25] [--out f.json]
    python benchmarks/profile_serve.py --preset tiny --device cpu --prompts 300 --max-batched-tokens 96

Each prompt runs twice alone: the first call pays for what a new shape costs (kernel compilation, attention plans),
the second shows the steady state. Every iteration is timed with the device synchronised around it (only here: the
engine itself never waits for the device). Random weights, the byte vocabulary, bf16 on CUDA. Prints the figures,
then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import emit_json, env_info, log
from bench_prefill import tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package (run from any directory)

from hybrid_attention.device import resolve_device, resolve_dtype  # noqa: E402
from hybrid_attention.inference.engine import Engine  # noqa: E402
from hybrid_attention.inference.engine_config import EngineConfig  # noqa: E402
from hybrid_attention.inference.model_source import load_for_serving  # noqa: E402
from hybrid_attention.inference.requests import Request, SamplingParams  # noqa: E402


class Timeline:
    """Steps the engine and records each iteration: its milliseconds (and those until the engine's step returned,
    having queued its device work), the prefill chunks it ran, the prompt tokens it prefilled of a watched request,
    and the sequences that decoded in it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.device = engine.device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, watched: Request | None = None) -> dict:
        counters, seq = self.engine.counters, watched.seq if watched else None
        chunks, prefilled = counters["prefill_chunks"], seq.prefilled if seq else 0
        decoding = len(self.engine.scheduler.decoding)
        self.sync()
        start = time.perf_counter()
        self.engine.step()
        host_ms = (time.perf_counter() - start) * 1e3  # the engine never waits for this iteration's device work
        self.sync()
        ms = (time.perf_counter() - start) * 1e3
        row = dict(ms=ms, host_ms=host_ms, chunks=counters["prefill_chunks"] - chunks, decoding=decoding)
        row["tokens"] = seq.prefilled - prefilled if seq else 0
        return row

    def until(self, done, watched: Request | None = None) -> list[dict]:
        rows = []
        while not done():
            rows.append(self.step(watched))
        return rows


def request(length: int, max_tokens: int, vocab: int, on_event) -> Request:
    prompt = torch.randint(0, vocab, (length,)).tolist()
    return Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), on_event)


def first_token(timeline: Timeline, length: int, vocab: int) -> dict:
    """Submit one prompt; iterate until its first token is out. Its TTFT and the iterations that prefilled it."""
    seen: list[float] = []
    watched = request(length, 2, vocab, lambda event: seen or seen.append(time.perf_counter()))
    start = time.perf_counter()
    timeline.engine.submit([watched])
    rows = [r for r in timeline.until(lambda: bool(seen), watched) if r["tokens"]]
    return dict(
        ttft_s=seen[0] - start,
        prefill_iterations=len(rows),
        chunk_tokens=[r["tokens"] for r in rows],
        iteration_ms=[round(r["ms"], 3) for r in rows],
        host_ms=[round(r["host_ms"], 3) for r in rows],
    )


def describe(name: str, row: dict) -> str:
    ms = row["iteration_ms"]
    return (
        f"{name}: TTFT {row['ttft_s']:.3f} s over {row['prefill_iterations']} prefill iterations "
        f"(chunks of {statistics.median(row['chunk_tokens']):.0f} tokens, median {statistics.median(ms):.1f} ms, "
        f"max {max(ms):.1f} ms each; the host's part: median {statistics.median(row['host_ms']):.1f} ms)"
    )


def profile_iteration(timeline: Timeline, top: int) -> str:
    """torch.profiler's table of one engine iteration (device time first on CUDA), then its host functions."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    on_cuda = timeline.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    timeline.sync()
    with profile(activities=activities) as prof:
        timeline.engine.step()
        timeline.sync()
    sort = "cuda_time_total" if on_cuda else "cpu_time_total"
    text = prof.key_averages().table(sort_by=sort, row_limit=top)
    host = cProfile.Profile()
    host.enable()
    timeline.engine.step()
    timeline.sync()
    host.disable()
    stream = io.StringIO()
    pstats.Stats(host, stream=stream).sort_stats("tottime").print_stats(top)
    return f"{text}\nhost functions of the next iteration, by own time:\n{stream.getvalue()}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-scaled")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", default="32K,128K", help="prompt lengths, comma-separated (K = 1024)")
    p.add_argument("--decoding", type=int, default=8, help="sequences decoding while a prompt joins")
    p.add_argument("--max-batched-tokens", type=int, help="default: the engine's for the device")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--top", type=int, default=25, help="rows of the profile tables (0: no profile)")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args(argv)
    try:
        lengths = [tokens(x) for x in args.prompts.split(",")]
        device = resolve_device(args.device)
    except Exception as exc:
        p.error(str(exc))
    torch.manual_seed(0)
    model, tokenizer, _ = load_for_serving(preset=args.preset, device=device, dtype=resolve_dtype(device, "auto"))
    vocab = model.config.vocab_size
    longest = max(lengths)
    config = EngineConfig(
        max_running=args.max_running,
        max_context=longest + 4096,
        max_batched_tokens=args.max_batched_tokens,
    )
    start = time.perf_counter()
    engine = Engine(model, tokenizer, config)
    engine.warm_up()
    log(f"engine ready in {time.perf_counter() - start:.1f} s: idle chunks of {engine.idle_prefill_tokens} tokens")
    timeline = Timeline(engine)
    result = dict(env=env_info(["benchmarks/profile_serve.py", *argv]), preset=args.preset, device=str(device))
    result.update(idle_prefill_tokens=engine.idle_prefill_tokens, max_batched_tokens=engine.max_batched_tokens)
    result["alone"] = {}
    for length in lengths:
        runs = []
        for call in ("first", "second"):
            runs.append(first_token(timeline, length, vocab))
            timeline.until(engine.idle)
            print(describe(f"{length} tokens alone, {call} call", runs[-1]), flush=True)
        result["alone"][length] = runs
    # Sequences that decode for the rest of the run, then each prompt joins them.
    engine.submit([request(16, longest + 2048, vocab, lambda event: None) for _ in range(args.decoding)])
    timeline.until(lambda: len(engine.scheduler.decoding) == args.decoding)
    decode_only = [timeline.step()["ms"] for _ in range(20)]
    result["decode_only_ms"] = statistics.median(decode_only)
    print(f"an iteration of {args.decoding} decoding sequences alone: {result['decode_only_ms']:.2f} ms", flush=True)
    result["joining"] = {}
    for length in lengths:
        row = first_token(timeline, length, vocab)
        result["joining"][length] = row
        print(describe(f"{length} tokens joining {args.decoding} decoding", row), flush=True)
    if args.top > 0:
        events: list = []
        engine.submit([request(lengths[0], 2, vocab, events.append)])
        timeline.step()  # the first chunk: the profiled iteration reads a cached prefix
        if events:
            print(f"\nno iteration profiled: the {lengths[0]}-token prompt was prefilled in one iteration")
        else:
            print(f"\none iteration: a later chunk of a {lengths[0]}-token prompt and {args.decoding} decode steps")
            print(profile_iteration(timeline, args.top))
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
