"""`hybrid-attention serve`: the OpenAI completions API on FastAPI + uvicorn, in a process of its own beside the
engine's (`run_server`), linked by a pipe (engine_link.py): routes check requests (openai_api.py), submit prompts and
turn the engine's events into responses or server-sent events; no model code and no torch in the HTTP process
(docs/inference.md, "Serving").
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import signal
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybrid_attention.inference.engine_link import EngineClient, EngineHost
from hybrid_attention.inference.openai_api import (
    ApiError,
    ChunkEncoder,
    chunk_body,
    completion_body,
    error_body,
    new_id,
    parse_completion,
    usage,
)
from hybrid_attention.inference.requests import ENDINGS
from hybrid_attention.inference.scheduler import QueueFull, ShuttingDown

RETRY_AFTER_S = 1  # what a refused client is told to wait: a few decode steps free a queue place


@dataclass
class HttpSettings:
    """What the HTTP process needs to know of the server (it holds no model)."""

    host: str
    port: int
    model_name: str
    tokenizer: object
    vocab_size: int
    max_context: int
    shutdown_timeout: float
    stream_interval: float = 0.0


class _EngineMetrics:
    """The engine's counts as Prometheus metrics: `counts`, fetched from the engine before each scrape."""

    counts: dict = {}

    def collect(self):
        s = self.counts
        gauges = [
            ("queue_depth", "requests waiting for cache", s["queue_depth"]),
            ("running_sequences", "sequences holding cache (prefilling or decoding)", s["running"]),
            ("decoding_sequences", "sequences in the decode batch", s["decoding"]),
            ("cache_pages_in_use", "latent cache pages held by sequences", s["pages_used"]),
            ("cache_pages_total", "latent cache pages", s["pages_total"]),
            ("state_slots_in_use", "KDA state slots held by sequences", s["slots_used"]),
            ("tokens_per_second", "generated tokens per second over the last 10 s", s["tokens_per_s"]),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"hybrid_attention_{name}", doc, value=value)
        for name, doc in (
            ("generated_tokens", "tokens generated"),
            ("prompt_tokens", "prompt tokens of ended requests"),
            ("prefill_chunks", "prompt chunks run (a prompt alone prefills in few, large ones)"),
        ):
            yield CounterMetricFamily(f"hybrid_attention_{name}", doc, value=s.get(name, 0))
        ended = CounterMetricFamily("hybrid_attention_requests_ended", "prompts ended, by outcome", labels=["outcome"])
        for outcome in ENDINGS:
            ended.add_metric([outcome], s.get(f"finished_{outcome}", 0))
        yield ended


async def _disconnected(http: HttpRequest) -> None:
    """Returns once the client has gone away (the request body is already read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(link: EngineClient, settings: HttpSettings) -> FastAPI:
    """The routes over the engine at the other end of `link`, which the app's lifespan attaches to its event loop."""

    @asynccontextmanager
    async def lifespan(app):
        link.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="hybrid-attention", lifespan=lifespan, docs_url=None, redoc_url=None)
    registry = CollectorRegistry()
    engine_metrics = _EngineMetrics()
    registry.register(engine_metrics)
    responses = Counter("hybrid_attention_http_requests", "HTTP responses", ["route", "status"], registry=registry)
    created = int(time.time())
    model_name = settings.model_name

    def answer(route: str, status: int, response: Response) -> Response:
        responses.labels(route, str(status)).inc()
        return response

    def error(err: ApiError) -> Response:
        body = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        return answer("/v1/completions", err.status, body)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        try:
            try:
                body = json.loads(await http.body())
            except (ValueError, UnicodeDecodeError):
                raise ApiError(400, "the request body is not valid JSON") from None
            parsed = parse_completion(
                body,
                tokenizer=settings.tokenizer,
                vocab_size=settings.vocab_size,
                model_name=model_name,
                max_context=settings.max_context,
            )
            try:
                key, queue = await link.submit(parsed.prompts, parsed.params)
            except QueueFull as e:
                raise ApiError(
                    429,
                    f"{e}; retry later",
                    kind="requests",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            except ShuttingDown as e:
                raise ApiError(503, str(e), kind="server_error") from None
            except ValueError as e:  # what the engine refuses and the checks above let through
                raise ApiError(400, str(e)) from None
        except ApiError as err:
            return error(err)
        completion_id, n = new_id(), len(parsed.prompts)
        end = lambda cancel: link.close(key, cancel=cancel)  # noqa: E731
        if parsed.stream:
            events = _stream(end, queue, n, completion_id, model_name, parsed.include_usage, settings.stream_interval)
            stream = StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return answer("/v1/completions", 200, stream)
        return await _collect(http, end, queue, n, completion_id, model_name, error, answer)

    @app.get("/v1/models")
    async def models():
        card = dict(
            id=model_name,
            object="model",
            created=created,
            owned_by="hybrid-attention",
            max_model_len=settings.max_context,
        )
        return answer("/v1/models", 200, JSONResponse({"object": "list", "data": [card]}))

    @app.get("/health")
    async def health():
        if link.draining:
            return answer("/health", 503, JSONResponse({"status": "shutting down"}, status_code=503))
        return answer("/health", 200, JSONResponse({"status": "ok"}))

    @app.get("/metrics")
    async def metrics():
        try:
            engine_metrics.counts = await link.stats()
        except ShuttingDown as e:
            return answer("/metrics", 503, JSONResponse(error_body(str(e), kind="server_error"), status_code=503))
        return answer("/metrics", 200, Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST))

    return app


def _take(queue: asyncio.Queue, first) -> list:
    """`first` and whatever else waits in the queue."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def _collect(http, end, queue, n, completion_id, model_name, error, answer) -> Response:
    """A whole (non-streamed) response, once every prompt has ended; a client that goes away first cancels them.
    `end(cancel)` is called once at the end."""
    texts, finals = [[] for _ in range(n)], [None] * n
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        while None in finals:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return Response(status_code=499)  # nobody reads it
            for index, event in _take(queue, getter.result()):
                if event.error:
                    return error(ApiError(event.status, event.error, kind="server_error"))
                texts[index].append(event.text)
                if event.final:
                    finals[index] = event
    finally:
        watcher.cancel()
        end(None in finals)
    choices = [("".join(texts[i]), finals[i].finish_reason) for i in range(n)]
    tokens = (sum(e.prompt_tokens for e in finals), sum(e.completion_tokens for e in finals))
    return answer("/v1/completions", 200, JSONResponse(completion_body(completion_id, model_name, choices, tokens)))


async def _stream(end, queue, n, completion_id, model_name, include_usage, interval: float):
    """Server-sent events: a chunk per wake-up (at most one per `interval` seconds) with the text each prompt
    gained, an error event if one fails, the usage chunk when asked for, then `data: [DONE]`. `end(cancel)` is called
    once at the end, cancel true when prompts still run (the client left)."""
    ended, prompt_tokens, completion_tokens = 0, 0, 0
    encoder = ChunkEncoder(completion_id, model_name, include_usage=include_usage)
    loop, sent = asyncio.get_running_loop(), -math.inf
    try:
        failed = None
        while ended < n and failed is None:
            if sent + interval > loop.time():  # fewer, larger chunks: less work per token for the event loop
                await asyncio.sleep(sent + interval - loop.time())
            merged: dict[int, list] = {}
            for index, event in _take(queue, await queue.get()):
                if event.text or not event.error:  # also without text (part of a character): a client times tokens
                    entry = merged.setdefault(index, ["", None])
                    entry[0] += event.text
                if event.error:
                    failed = event
                    break
                if event.final:
                    entry[1] = event.finish_reason
                    ended += 1
                    prompt_tokens += event.prompt_tokens
                    completion_tokens += event.completion_tokens
            if merged:
                yield encoder.encode([(index, text, reason) for index, (text, reason) in merged.items()])
                sent = loop.time()
        if failed is not None:
            yield f"data: {json.dumps(error_body(failed.error, kind='server_error'))}\n\n"
        elif include_usage:
            totals = usage(prompt_tokens, completion_tokens)
            body = chunk_body(completion_id, model_name, [], include_usage=True, usage_=totals)
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        end(ended < n)


class _Server(uvicorn.Server):
    """uvicorn's server in the HTTP process: it tells the engine's process once it listens, and leaves signals to
    that process, which drains the engine and then tells it to stop (`EngineClient.on_shutdown`)."""

    def __init__(self, config: uvicorn.Config, link: EngineClient):
        super().__init__(config)
        self.link = link
        link.on_shutdown = self._shutdown

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.link.ready(*self.servers[0].sockets[0].getsockname()[:2])

    def handle_exit(self, sig, frame) -> None:
        pass  # Ctrl-C reaches both processes: the engine's decides

    def _shutdown(self, force: bool) -> None:
        self.should_exit = True
        self.force_exit = self.force_exit or force


def _http_main(conn, settings: HttpSettings) -> None:
    """The HTTP process: uvicorn serving `create_app` until the engine's process says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until uvicorn installs its own handler
    link = EngineClient(conn)
    app = create_app(link, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout + 5,
    )
    _Server(config, link).run()


def run_server(
    engine,
    *,
    host: str,
    port: int,
    model_name: str,
    shutdown_timeout: float,
    on_ready,
    stream_interval: float = 0.0,
) -> None:
    """Serve `engine` (warmed up) until SIGTERM or Ctrl-C; `on_ready(host, port)` once the socket listens (port 0: a
    free one). The engine runs on a thread of this process; the HTTP side in a spawned process of its own, so that
    turning tokens into events never competes with the engine's host work for one interpreter lock. The first
    signal stops admitting and drains (`Engine.drain`), a second one stops at once."""
    settings = HttpSettings(
        host=host,
        port=port,
        model_name=model_name,
        tokenizer=engine.tokenizer,
        vocab_size=engine.model.config.vocab_size,
        max_context=engine.config.max_context,
        shutdown_timeout=shutdown_timeout,
        stream_interval=stream_interval,
    )
    spawn = multiprocessing.get_context("spawn")  # the HTTP process holds no CUDA context and imports no torch
    ours, theirs = spawn.Pipe()
    front = spawn.Process(target=_http_main, args=(theirs, settings), name="hybrid-attention-http", daemon=True)
    front.start()
    theirs.close()  # so that its end closing shows here as the end of the pipe
    link = EngineHost(engine, ours)
    signals = []

    def on_signal(sig, frame) -> None:
        signals.append(sig)
        name = signal.Signals(sig).name
        if len(signals) == 1:
            engine.drain(shutdown_timeout)
            running = engine.stats()["running"]
            say(
                f"{name}: taking no new requests; {running} running may finish for up to {shutdown_timeout:g} s "
                "(a second signal stops at once)"
            )
        else:
            say(f"{name} again: stopping now")
        link.shutdown(force=len(signals) > 1)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        engine.start()
        link.serve(on_ready)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.stop()
        link.close()
        front.join(timeout=10)
        if front.is_alive():
            front.kill()
    if not signals and front.exitcode:
        raise SystemExit(f"hybrid-attention serve: the HTTP process ended with exit code {front.exitcode}")
    counts = engine.stats()
    done = {reason: counts[f"finished_{reason}"] for reason in ENDINGS}
    say("stopped; requests by how they ended: " + ", ".join(f"{n} {reason}" for reason, n in done.items()))


def say(line: str) -> None:
    """One line of the server's log (stderr)."""
    print(f"hybrid-attention serve: {line}", file=sys.stderr, flush=True)
