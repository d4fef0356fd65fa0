"""Benchmark: `hybrid-attention serve` under load, against the all-MLA preset and a static-batching server.

Each server runs in a process of its own and is driven over HTTP by serve_load.py (aiohttp): streamed greedy requests
of random token ids arriving as a Poisson process. Per scenario (prompt / output lengths) and system, a search over
the arrival rate finds the highest rate whose trial holds TTFT p99 <= 2 s and TPOT p99 <= 50 ms; reported for it:
requests/s, output tokens/s, TTFT and TPOT p50/p99, running sequences and latent cache in use.

Systems: "hybrid" (`serve --preset k3-scaled`, random weights, byte vocabulary, bf16), "all-mla" (`--preset
k3-scaled-all-mla`) and "static": the same hybrid model's `generate()` on batches taken in arrival order (what a user
would otherwise write: a batch starts when the previous one has ended, and its first tokens come after all its
prompts are prefilled), served by the minimal server in this file (`--static-server`). The "overhead" case sends 64
requests at once (3K prompts, 2K outputs) and reads the hybrid server's decode tokens/s while all 64 decode (mean
context about 4K), next to `bench_decode.py`'s CUDA-graph step at batch 64 and 4K on the same model in this process.

    python benchmarks/bench_serve.py [--quick] [--out results.json] [--plot benchmarks/serve_rates.png]

Every scenario generates 256 tokens per request unless `--output-tokens` says otherwise: after a 32K or 128K prompt,
256 tokens leave the prefill dominating each request's cost, where the two models differ by their prefill times;
with long outputs (`--output-tokens 2048 --max-running 256`) decoding dominates, many sequences run together, and
each decode step reads every running sequence's cache, the bytes in which the hybrid and all-MLA differ most.

The static baseline runs first, and each search gets a fair share of what is left of --budget-s. Every trial is
listed with its verdict: held, or which request broke which limit, by how much, and the server's load then.
`--quick` runs tiny models on the CPU in about two minutes (one scenario, a TPOT limit of 250 ms), and the overhead
case on a micro model (hidden 32, one KDA and one MLA layer) whose decode step is short enough that the server's
host-side costs show, against that step timed alone on the same cache. Prints tables, then one JSON line (also
written to --out). Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import checkout_env, emit_json, log
from serve_load import Limits, parse_lengths, run_trial, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, here and in the servers it starts (run from any directory)
# name: (prompt lengths, output lengths, systems, first rate tried per second)
SCENARIOS = {
    "4K": ("4096", "256", ["hybrid", "static"], 2.0),
    "32K": ("32768", "256", ["hybrid", "all-mla"], 0.4),
    "128K": ("131072", "256", ["hybrid", "all-mla"], 0.25),
}
QUICK = {"quick": ("32:64", "8:16", ["hybrid", "all-mla", "static"], 2.0)}
# The CPU overhead case: a model whose decode step at batch 64 takes a few milliseconds on a CPU core.
MICRO = dict(hidden_size=32, layer_types=("kda", "mla"), intermediate_size=64, kda_num_heads=1, mla_num_heads=1)
QUICK_OVERHEAD = dict(prompt=16, output=200, max_context=256, page_size=16)
PRESETS = {"hybrid": "k3-scaled", "all-mla": "k3-scaled-all-mla", "static": "k3-scaled"}


# ------------------------------------------------------------------------------------------- the static server
def static_server(args) -> int:
    """A minimal static-batching server: one thread runs `generate_stream` on the requests waiting when the previous
    batch ended (arrival order, at most --max-running), streaming each request's tokens as they come."""
    import queue

    import torch
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from hybrid_attention.device import resolve_device, resolve_dtype
    from hybrid_attention.inference.generate import generate_stream
    from hybrid_attention.inference.model_source import load_for_serving

    device = resolve_device(args.device)
    model, tokenizer, name = load_for_serving(
        ckpt=args.ckpt, preset=args.preset, device=device, dtype=resolve_dtype(device, "auto")
    )
    inbox: queue.Queue = queue.Queue()
    running = [0]
    loop_box = []

    def worker() -> None:
        if device.type == "cpu":  # as the engine's thread: KDA's decay products make denormals, slow on CPUs
            torch.set_flush_denormal(True)
        while True:
            batch = [inbox.get()]
            while len(batch) < args.max_running and not inbox.empty():
                batch.append(inbox.get_nowait())
            running[0] = len(batch)
            prompts = [torch.tensor(r["prompt"], device=device) for r in batch]
            steps = max(r["max_tokens"] for r in batch)
            for step, tokens in enumerate(generate_stream(model, prompts, steps, temperature=0)):
                for r, token in zip(batch, tokens.tolist(), strict=True):
                    if step < r["max_tokens"]:
                        loop_box[0].call_soon_threadsafe(r["queue"].put_nowait, token)
            running[0] = 0

    async def completions(http):
        body = await http.json()
        r = dict(prompt=body["prompt"], max_tokens=body.get("max_tokens", 16), queue=asyncio.Queue())
        if not loop_box:
            loop_box.append(asyncio.get_running_loop())
            threading.Thread(target=worker, daemon=True).start()
        inbox.put(r)

        async def events():
            for i in range(r["max_tokens"]):
                text = tokenizer.token_bytes(await r["queue"].get()).decode("utf-8", errors="replace")
                reason = "length" if i + 1 == r["max_tokens"] else None
                yield f"data: {json.dumps(dict(choices=[dict(index=0, text=text, finish_reason=reason)]))}\n\n"
            usage = dict(prompt_tokens=len(r["prompt"]), completion_tokens=r["max_tokens"])
            yield f"data: {json.dumps(dict(choices=[], usage=usage))}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(http):
        lines = [f"hybrid_attention_running_sequences {running[0]}", f"hybrid_attention_queue_depth {inbox.qsize()}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/metrics", metrics)]
    app = Starlette(routes=routes)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"static server: ready at http://{host}:{port}/v1, model {name!r}", file=sys.stderr, flush=True)

    Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).run()
    return 0


# ------------------------------------------------------------------------------------------------- processes
class ServerProcess:
    """A server command in a new process; `url` once its ready line shows, its stderr in `log_path`."""

    def __init__(self, argv: list[str], log_path: Path, timeout: float = 900.0, env: dict | None = None):
        env = checkout_env(**(env or {}))
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.url, ready = None, threading.Event()

        def read() -> None:
            with open(log_path, "a") as log_file:
                for line in self.process.stderr:
                    log_file.write(line)
                    log_file.flush()
                    if self.url is None and "ready at http://" in line:
                        self.url = line.split("ready at ", 1)[1].split("/v1", 1)[0]
                        ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"the server did not start: {' '.join(argv)} (its log: {log_path})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_argv(system: str, args, source: list[str]) -> list[str]:
    limits = ["--max-running", str(args.max_running)]
    if system == "static":
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            "--static-server",
            *source,
            *limits,
            "--device",
            args.device,
        ]
    return [
        sys.executable,
        "-m",
        "hybrid_attention",
        "serve",
        *source,
        *limits,
        "--port",
        "0",
        "--device",
        args.device,
        "--max-context",
        str(args.max_context),
        *(["--max-batched-tokens", str(args.max_batched_tokens)] if args.max_batched_tokens else []),
        "--shutdown-timeout",
        "5",
        *args.server_args.split(),
    ]


def wait_idle(url: str, timeout: float = 600.0) -> None:
    """Until the server runs and queues nothing (an aborted trial's requests end or are cancelled)."""
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines() if line[:1] != "#"}
        if (
            values.get("hybrid_attention_running_sequences", 0) == 0
            and values.get("hybrid_attention_queue_depth", 0) == 0
        ):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} stayed busy for {timeout} s")


# ----------------------------------------------------------------------------------------------- measurement
def search_rate(url: str, scenario: str, spec: tuple, args, limits: Limits, page_bytes: int | None, seconds: float):
    """The highest arrival rate that holds the limits: double (or halve) from the scenario's first rate until a trial
    fails (holds), then bisect geometrically until the bracket is within 30%, starting trials for `seconds`."""
    prompt_len, output_len = (parse_lengths(s) for s in spec[:2])
    start = spec[3]
    kw = dict(prompt_len=prompt_len, output_len=output_len, vocab=256, limits=limits)
    asyncio.run(run_trial(url, "", rate=math.inf, num_requests=2, **kw, stop_on_break=False))  # first-use costs
    wait_idle(url)
    trials, held, broke, rate = [], None, None, start
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(trials) < args.max_trials:
        n = max(args.min_requests, min(args.max_requests, round(rate * args.trial_s)))
        n = min(n, max(3, int(3 * args.trial_s * rate)))  # slow rates: fewer requests, not minutes of arrivals
        row = summarize(
            asyncio.run(run_trial(url, "", rate=rate, num_requests=n, seed=len(trials), **kw)), limits, page_bytes
        )
        trials.append(row)
        log(f"  {scenario}: {n} requests at {rate:.3g}/s: " + ("held" if row["held"] else trial_verdict(row)))
        wait_idle(url)
        if row["held"]:
            held = row
        else:
            broke = row
        if held and broke and broke["rate"] / held["rate"] <= 1.3:
            break
        if broke is None:
            rate *= 2
        elif held is None:
            rate /= 2
            if rate < start / 64:
                break
        else:
            rate = math.sqrt(held["rate"] * broke["rate"])
    return dict(trials=trials, max_rate=held["rate"] if held else 0.0, at_max=held)


def trial_verdict(row: dict) -> str:
    """Why a trial did not hold: the request that broke a limit, or the percentile over it."""
    if row["held"]:
        return "held"
    if row.get("broke"):
        return f"{row['broke']}; {row['in_flight']} requests still without a first token"
    if row["completed"] < row["requests"]:
        return f"{row['requests'] - row['completed']} of {row['requests']} requests did not complete"
    return f"TTFT p99 {row['ttft_p99']:.3f} s, TPOT p99 {row['tpot_p99'] or 0:.4f} s over the limits"


def overhead_case(url: str, args) -> dict:
    """64 requests at once; decode tokens/s from the server's counters while all of them decode."""
    kw = dict(
        prompt_len=parse_lengths(str(args.overhead_prompt)),
        output_len=parse_lengths(str(args.overhead_output)),
        vocab=256,
        limits=Limits(math.inf, math.inf),
    )
    trial = asyncio.run(
        run_trial(url, "", rate=math.inf, num_requests=args.max_running, stop_on_break=False, scrape_every=0.1, **kw)
    )
    full = [s for s in trial.samples if s.get("decoding_sequences") == args.max_running]
    row = dict(batch=args.max_running, prompt=args.overhead_prompt, output=args.overhead_output, samples=len(full))
    tokens = [o.completion_tokens for o in trial.outcomes if o.chunks]
    if tokens:  # several tokens per stream event when the HTTP side coalesces
        row["tokens_per_event"] = sum(tokens) / sum(o.chunks for o in trial.outcomes if o.chunks)
    if len(full) >= 2 and full[-1]["t"] > full[0]["t"]:
        tokens = full[-1]["generated_tokens_total"] - full[0]["generated_tokens_total"]
        row.update(window_s=full[-1]["t"] - full[0]["t"], tokens_per_s=tokens / (full[-1]["t"] - full[0]["t"]))
    return row


def decode_anchor(preset: str, batch: int, context: int) -> dict:
    """bench_decode.py's CUDA-graph decode step on the served model (same preset, byte vocabulary, bf16)."""
    import torch
    from bench_decode import decode_case, free_memory

    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset(preset, vocab_size=256)).to("cuda", torch.bfloat16).eval()
    try:
        return decode_case(model, "hybrid", batch, context, reps=50, with_eager=False)
    finally:
        del model
        free_memory()


def cpu_decode_anchor(run_dir: Path, batch: int, context: int, max_context: int, page_size: int) -> dict:
    """The engine's own decode step (eager, on the CPU) at `batch` sequences of `context` tokens over a paged cache
    shaped as the server's, timed alone: what the server's decode could reach with no host or HTTP work around it."""
    import torch

    from hybrid_attention.inference.decode_graph import DecodeStep
    from hybrid_attention.inference.paged_cache import PagedCache
    from hybrid_attention.runs.checkpoint import load_run

    torch.set_flush_denormal(True)  # as the engine's thread
    torch.set_num_threads(1)  # as the server in the CPU overhead case: a loaded machine's cores make no noise
    model = load_run(run_dir)[0].eval()
    pages = -(-max_context // page_size)
    cache = PagedCache(
        model,
        num_pages=batch * pages,
        page_size=page_size,
        num_slots=batch,
        max_context=max_context,
        device="cpu",
        dtype=torch.float32,
    )
    for slot in range(batch):
        cache.set_pages(slot, range(1 + slot * pages, 1 + (slot + 1) * pages))
    step = DecodeStep(model, cache.batch(0, batch), cuda_graph=False)
    tokens = torch.randint(0, model.config.vocab_size, (batch,))
    times = []
    for _ in range(30):
        step.cache.seqlens.set(context)
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    ms = 1e3 * sorted(times)[len(times) // 2]
    return dict(B=batch, context=context, ms=ms, tokens_per_s=batch / ms * 1e3, device="cpu")


def quick_overhead(args, workdir: Path) -> dict:
    """The overhead case on the CPU: a micro model's server at 64 running sequences against its decode step alone."""
    import copy

    import torch

    from hybrid_attention.config import HybridConfig
    from hybrid_attention.data.tokenizer import ByteTokenizer
    from hybrid_attention.model import HybridLM
    from hybrid_attention.training.model_run import save_model_run

    torch.manual_seed(0)
    run_dir = save_model_run(workdir / "micro", HybridLM(HybridConfig.from_preset("tiny", **MICRO)), ByteTokenizer())
    o = QUICK_OVERHEAD
    micro = copy.copy(args)
    micro.max_running, micro.max_context, micro.max_batched_tokens = 64, o["max_context"], 2048
    micro.overhead_prompt, micro.overhead_output = o["prompt"], o["output"]
    micro.server_args = f"{args.server_args} --page-size {o['page_size']}"
    log("overhead case on the CPU: a micro model at 64 running sequences")
    anchor = cpu_decode_anchor(run_dir, 64, o["prompt"] + o["output"] // 2, o["max_context"], o["page_size"])
    row = dict(anchor_tokens_per_s=anchor["tokens_per_s"], anchor=anchor, model="micro (hidden 32, KDA + MLA)")
    argv = server_argv("hybrid", micro, ["--ckpt", str(run_dir)])
    server = ServerProcess(argv, workdir / "micro.log", env={"OMP_NUM_THREADS": "1"})
    try:
        row.update(overhead_case(server.url, micro))
    finally:
        server.stop()
    return row


def print_tables(results: dict, overhead: dict | None) -> None:
    print("\nHighest sustainable rate (TTFT p99 and TPOT p99 within the limits)")
    print(
        f"{'scenario':8} {'system':8} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'running':>8} {'cache GB':>9}"
    )
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    for scenario, systems in results.items():
        for system, found in systems.items():
            at = found.get("at_max") or {}
            print(
                f"{scenario:8} {system:8} {found.get('max_rate', 0):>7.3g} "
                f"{fmt(at.get('output_tokens_per_s'), '>10.0f')} "
                f"{fmt(at.get('ttft_p50'), '>9.3f')} {fmt(at.get('ttft_p99'), '>9.3f')} "
                f"{fmt(at.get('tpot_p50'), '>9.4f')} {fmt(at.get('tpot_p99'), '>9.4f')} "
                f"{fmt(at.get('running_max'), '>8.0f')} {fmt(at.get('cache_GB_max'), '>9.2f')}"
                + (f"  {found['error']}" if "error" in found else "")
            )
    print("\nEvery trial")
    head = f"{'scenario':8} {'system':8} {'rate':>6} {'done':>7} {'TTFT p99':>9} {'TPOT p99':>9} {'running':>8}"
    print(head + "  verdict")
    for scenario, systems in results.items():
        for system, found in systems.items():
            for t in found.get("trials", []):
                print(
                    f"{scenario:8} {system:8} {t['rate']:>6.3g} {t['completed']:>3}/{t['requests']:<3} "
                    f"{fmt(t.get('ttft_p99'), '>9.3f')} {fmt(t.get('tpot_p99'), '>9.4f')} "
                    f"{fmt(t.get('running_max'), '>8.0f')}  {trial_verdict(t)}"
                )
    if overhead:
        http, alone = overhead.get("tokens_per_s"), overhead.get("anchor_tokens_per_s")
        print(
            f"\nDecode at batch {overhead.get('batch')}: {fmt(http, '.0f') or 'not measured'} tokens/s through HTTP, "
            f"{fmt(alone, '.0f')} for the decode step alone"
            + (f" ({http / alone:.2f} of it)" if http and alone else "")
            + f", {fmt(overhead.get('tokens_per_event'), '.2f')} tokens per stream event"
        )


def thresholds(results: dict, overhead: dict | None) -> dict:
    """The benchmark's thresholds: the server's sustainable rate >= 3x static batching's at 4K; the hybrid's
    sustainable output tokens/s >= 3x all-MLA's at 32K and 128K; decode through HTTP >= 90% of bench_decode."""
    out = {}
    four = results.get("4K", {})
    if "hybrid" in four and "static" in four:
        h, s = four["hybrid"].get("max_rate", 0), four["static"].get("max_rate", 0)
        out["4K_rate_vs_static_ge_3"] = dict(
            hybrid=h, static=s, ratio=h / s if s else math.inf, met=h >= 3 * s and h > 0
        )
    for name in ("32K", "128K"):
        pair = results.get(name, {})
        if "hybrid" in pair and "all-mla" in pair:
            tok = lambda f: (f.get("at_max") or {}).get("output_tokens_per_s", 0.0)  # noqa: E731
            h, m = tok(pair["hybrid"]), tok(pair["all-mla"])
            out[f"{name}_tokens_vs_all_mla_ge_3"] = dict(
                hybrid=h, all_mla=m, ratio=h / m if m else math.inf, met=h >= 3 * m and h > 0
            )
    if overhead and "tokens_per_s" in overhead and overhead.get("anchor_tokens_per_s"):
        frac = overhead["tokens_per_s"] / overhead["anchor_tokens_per_s"]
        out["http_decode_vs_bench_decode_ge_0.9"] = dict(fraction=frac, met=frac >= 0.9)
    return out


def plot(results: dict, path: str, limits: Limits) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as exc:
        return f"no plot: {exc!r}"
    fig, axes = plt.subplots(2, len(results), figsize=(4.5 * len(results), 7), squeeze=False)
    for col, (scenario, systems) in enumerate(results.items()):
        panels = (("ttft_p99", limits.ttft_s, "TTFT p99 (s)"), ("tpot_p99", limits.tpot_s, "TPOT p99 (s)"))
        for row, (key, limit, label) in enumerate(panels):
            ax = axes[row][col]
            for system, found in systems.items():
                trials = sorted((t for t in found.get("trials", []) if t.get(key) is not None), key=lambda t: t["rate"])
                if not trials:
                    continue
                (line,) = ax.plot([t["rate"] for t in trials], [t[key] for t in trials], marker="o", label=system)
                broken = [t for t in trials if not t.get("held")]  # their percentiles count the finished requests only
                ax.plot([t["rate"] for t in broken], [t[key] for t in broken], "x", color=line.get_color(), ms=11)
            ax.axhline(limit, color="gray", linestyle="--")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("arrival rate (requests/s)")
            ax.set_ylabel(label)
            ax.set_title(f"{scenario} (x: a trial that broke a limit)")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines[1:]:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models on the CPU, one scenario, about a minute")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), help="default: all")
    p.add_argument("--systems", nargs="+", choices=list(PRESETS), help="default: each scenario's")
    p.add_argument(
        "--output-tokens",
        help="output lengths of every scenario, N or LOW:HIGH (default 256; long outputs make decoding, and with it "
        "the cache, dominate the load where 256 tokens after a long prompt leave the prefill dominating)",
    )
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-context", type=int, default=131072 + 512)
    p.add_argument("--max-batched-tokens", type=int, help="default: the server's for the device")
    p.add_argument("--server-args", default="", help="more flags for `hybrid-attention serve`")
    p.add_argument("--search-s", type=float, default=50.0, help="seconds of trials per system and scenario")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting searches after this (default 540)")
    p.add_argument("--trial-s", type=float, default=10.0, help="seconds of arrivals per trial")
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--max-requests", type=int, default=256)
    p.add_argument("--max-trials", type=int, default=8)
    p.add_argument("--overhead-prompt", type=int, default=3072)
    p.add_argument("--overhead-output", type=int, default=2048)
    p.add_argument("--no-overhead", action="store_true")
    p.add_argument("--ttft-limit", type=float, default=2.0, help="seconds, p99 (default 2)")
    p.add_argument("--tpot-limit", type=float, default=None, help="seconds, p99 (default 0.05; --quick: 0.25)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent / "serve_rates.png"))
    p.add_argument("--static-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.static_server:
        return static_server(args)
    import torch

    from hybrid_attention.config import HybridConfig
    from hybrid_attention.inference.paged_cache import PagedCache
    from hybrid_attention.model import HybridLM

    t0 = time.monotonic()
    scenarios = QUICK if args.quick else {k: SCENARIOS[k] for k in (args.scenarios or SCENARIOS)}
    if args.output_tokens:
        try:
            parse_lengths(args.output_tokens)
        except ValueError as exc:
            p.error(f"--output-tokens: {exc}")
        scenarios = {name: (spec[0], args.output_tokens, *spec[2:]) for name, spec in scenarios.items()}
    if args.quick:
        args.device, args.max_running, args.max_context, args.max_batched_tokens = "cpu", 8, 256, 96
        args.search_s, args.trial_s, args.max_trials = 6.0, 2.0, 3
    limits = Limits(args.ttft_limit, args.tpot_limit or (0.25 if args.quick else 0.05))
    on_cuda = torch.cuda.is_available() and args.device != "cpu"
    env = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S"),
        gpu=torch.cuda.get_device_name() if on_cuda else "cpu",
        torch=torch.__version__,
        command="python benchmarks/bench_serve.py " + " ".join(argv),
    )
    result = dict(env=env, limits=vars(limits), scenarios={k: v[:2] for k, v in scenarios.items()})
    workdir = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    sources = {s: ["--preset", PRESETS[s]] for s in PRESETS}
    served = {s: HybridConfig.from_preset(PRESETS[s], vocab_size=256) for s in PRESETS}  # for the cache's bytes
    served_dtype = torch.bfloat16 if on_cuda else torch.float32
    if args.quick:  # tiny run directories: there is no tiny all-MLA preset
        from hybrid_attention.data.tokenizer import ByteTokenizer
        from hybrid_attention.training.model_run import save_model_run

        for system, layers in (("hybrid", None), ("all-mla", ("mla",) * 4)):
            torch.manual_seed(0)
            config = HybridConfig.from_preset("tiny", **({"layer_types": layers} if layers else {}))
            save_model_run(workdir / system, HybridLM(config), ByteTokenizer())
            served[system] = config
        sources = {
            "hybrid": ["--ckpt", str(workdir / "hybrid")],
            "all-mla": ["--ckpt", str(workdir / "all-mla")],
            "static": ["--ckpt", str(workdir / "hybrid")],
        }
    overhead = None
    if not args.no_overhead and on_cuda:
        context = args.overhead_prompt + args.overhead_output // 2
        log(f"bench_decode anchor: batch {args.max_running}, context {context}")
        anchor = decode_anchor(PRESETS["hybrid"], args.max_running, context)
        overhead = dict(anchor_tokens_per_s=anchor.get("tokens_per_s"), anchor=anchor)
    elif not args.no_overhead and args.quick:
        overhead = quick_overhead(args, workdir)
    results: dict[str, dict] = {name: {} for name in scenarios}
    # The static baseline first: the 4K comparison needs it, and it is the shortest search.
    order = [
        (system, [n for n, s in scenarios.items() if system in s[2] and (not args.systems or system in args.systems)])
        for system in ("static", "hybrid", "all-mla")
    ]
    searches_left = sum(len(wanted) for _, wanted in order)
    for system, wanted in order:
        if not wanted and not (system == "hybrid" and overhead is not None and on_cuda):
            continue
        with torch.device("meta"):
            page_bytes = (
                None if system == "static" else PagedCache.page_bytes(HybridLM(served[system]), 64, served_dtype)
            )
        log(f"starting {system} ({time.monotonic() - t0:.0f} s)")
        try:
            server = ServerProcess(server_argv(system, args, sources[system]), workdir / f"{system}.log")
        except RuntimeError as exc:
            for name in wanted:
                results[name][system] = dict(error=str(exc))
            searches_left -= len(wanted)
            continue
        try:
            if system == "hybrid" and overhead is not None and on_cuda:
                overhead.update(overhead_case(server.url, args))
                wait_idle(server.url)
            for name in wanted:
                left = args.budget_s - (time.monotonic() - t0)
                share = (left - 20) / searches_left  # each search left gets as long, the last ones too
                searches_left -= 1
                if share < 10:
                    results[name][system] = dict(error=f"skipped: {left:.0f} s left of --budget-s")
                    continue
                log(f"{system} {name} ({time.monotonic() - t0:.0f} s, up to {min(args.search_s, share):.0f} s)")
                try:
                    results[name][system] = search_rate(
                        server.url, name, scenarios[name], args, limits, page_bytes, min(args.search_s, share)
                    )
                except Exception as exc:
                    results[name][system] = dict(error=repr(exc)[:300])
        finally:
            server.stop()
        if args.out:  # what is measured so far survives a run cut short
            Path(args.out).write_text(json.dumps(dict(result, results=results, overhead=overhead), default=str) + "\n")
    print_tables(results, overhead)
    result.update(results=results, overhead=overhead, thresholds=thresholds(results, overhead))
    result["plot"] = plot(results, args.plot, limits) if args.plot else None
    result["elapsed_s"] = time.monotonic() - t0
    result["server_logs"] = str(workdir)
    print("\nThresholds:", json.dumps(result["thresholds"]))
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
