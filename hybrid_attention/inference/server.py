"""`hybrid-attention serve`: the OpenAI completions API on FastAPI + uvicorn, a thin layer over the engine: routes
check requests (openai_api.py), submit prompts and turn the engine's events into responses or server-sent events;
no model code runs here (docs/inference.md, "Serving").
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from contextlib import asynccontextmanager
from functools import partial

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybrid_attention.inference.engine import Engine, ShuttingDown
from hybrid_attention.inference.openai_api import (
    ApiError,
    chunk_body,
    completion_body,
    error_body,
    new_id,
    parse_completion,
    usage,
)
from hybrid_attention.inference.requests import Request
from hybrid_attention.inference.scheduler import QueueFull

RETRY_AFTER_S = 1  # what a refused client is told to wait: a few decode steps free a queue place


class _EngineMetrics:
    """The engine's counts as Prometheus metrics, read at every scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
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
        ):
            yield CounterMetricFamily(f"hybrid_attention_{name}", doc, value=s.get(name, 0))
        ended = CounterMetricFamily("hybrid_attention_requests_ended", "prompts ended, by outcome", labels=["outcome"])
        for outcome in ("stop", "length", "cancelled", "error"):
            ended.add_metric([outcome], s.get(f"finished_{outcome}", 0))
        yield ended


def _put(queue: asyncio.Queue, index: int, event) -> None:
    queue.put_nowait((index, event))


def _route(items) -> None:
    for request, event in items:
        request.sink(event)


async def _disconnected(http: HttpRequest) -> None:
    """Returns once the client has gone away (the request body is already read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: Engine, *, model_name: str, stream_interval: float = 0.0) -> FastAPI:
    """The routes over a warmed-up engine, which the app's lifespan starts and stops. stream_interval: the least
    time between two chunks of a stream, in seconds (0: a chunk whenever tokens have arrived)."""

    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        engine.deliver = lambda items: loop.call_soon_threadsafe(_route, items)
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="hybrid-attention", lifespan=lifespan, docs_url=None, redoc_url=None)
    registry = CollectorRegistry()
    registry.register(_EngineMetrics(engine))
    responses = Counter("hybrid_attention_http_requests", "HTTP responses", ["route", "status"], registry=registry)
    created = int(time.time())
    vocab_size = engine.model.config.vocab_size

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
                tokenizer=engine.tokenizer,
                vocab_size=vocab_size,
                model_name=model_name,
                max_context=engine.config.max_context,
            )
            queue: asyncio.Queue = asyncio.Queue()
            requests = [
                Request(ids, parsed.params, partial(_put, queue, i), index=i) for i, ids in enumerate(parsed.prompts)
            ]
            try:
                engine.submit(requests)
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
        completion_id = new_id()
        if parsed.stream:
            events = _stream(engine, requests, queue, completion_id, model_name, parsed.include_usage, stream_interval)
            stream = StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return answer("/v1/completions", 200, stream)
        return await _collect(http, engine, requests, queue, completion_id, model_name, error, answer)

    @app.get("/v1/models")
    async def models():
        card = dict(
            id=model_name,
            object="model",
            created=created,
            owned_by="hybrid-attention",
            max_model_len=engine.config.max_context,
        )
        return answer("/v1/models", 200, JSONResponse({"object": "list", "data": [card]}))

    @app.get("/health")
    async def health():
        if engine.draining:
            return answer("/health", 503, JSONResponse({"status": "shutting down"}, status_code=503))
        return answer("/health", 200, JSONResponse({"status": "ok"}))

    @app.get("/metrics")
    async def metrics():
        return answer("/metrics", 200, Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST))

    return app


async def _collect(http, engine, requests, queue, completion_id, model_name, error, answer) -> Response:
    """A whole (non-streamed) response, once every prompt has ended; a client that goes away first cancels them."""
    n = len(requests)
    texts, finals = [[] for _ in range(n)], [None] * n
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        while None in finals:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return Response(status_code=499)  # nobody reads it
            items = [getter.result()]
            while not queue.empty():
                items.append(queue.get_nowait())
            for index, event in items:
                if event.error:
                    return error(ApiError(event.status, event.error, kind="server_error"))
                texts[index].append(event.text)
                if event.final:
                    finals[index] = event
    finally:
        watcher.cancel()
        if None in finals:
            engine.cancel(requests)
    choices = [("".join(texts[i]), finals[i].finish_reason) for i in range(n)]
    tokens = (sum(e.prompt_tokens for e in finals), sum(e.completion_tokens for e in finals))
    return answer("/v1/completions", 200, JSONResponse(completion_body(completion_id, model_name, choices, tokens)))


async def _stream(engine, requests, queue, completion_id, model_name, include_usage, interval: float):
    """Server-sent events: a chunk per wake-up (at most one per `interval` seconds) with the text each prompt
    gained, an error event if one fails, the usage chunk when asked for, then `data: [DONE]`. Cancelled from outside
    (the client left): the prompts end."""
    n, ended, prompt_tokens, completion_tokens = len(requests), 0, 0, 0
    data = lambda body: f"data: {json.dumps(body)}\n\n"  # noqa: E731
    loop, sent = asyncio.get_running_loop(), -math.inf
    try:
        failed = None
        while ended < n and failed is None:
            if sent + interval > loop.time():  # fewer, larger chunks: less work per token for the event loop
                await asyncio.sleep(sent + interval - loop.time())
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            merged: dict[int, list] = {}
            for index, event in items:
                if event.error:
                    failed = event
                    break
                entry = merged.setdefault(index, ["", None])
                entry[0] += event.text
                if event.final:
                    entry[1] = event.finish_reason
                    ended += 1
                    prompt_tokens += event.prompt_tokens
                    completion_tokens += event.completion_tokens
            if merged:
                choices = [(index, text, reason) for index, (text, reason) in merged.items()]
                yield data(chunk_body(completion_id, model_name, choices, include_usage=include_usage))
                sent = loop.time()
        if failed is not None:
            yield data(error_body(failed.error, kind="server_error"))
        elif include_usage:
            totals = usage(prompt_tokens, completion_tokens)
            yield data(chunk_body(completion_id, model_name, [], include_usage=True, usage_=totals))
        yield "data: [DONE]\n\n"
    finally:
        if ended < n:
            engine.cancel(requests)


class _Server(uvicorn.Server):
    """uvicorn's server, which says once when it listens, and whose SIGTERM / Ctrl-C drains the engine first."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float, on_ready):
        super().__init__(config)
        self.engine, self.shutdown_timeout, self.on_ready = engine, shutdown_timeout, on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready(*self.servers[0].sockets[0].getsockname()[:2])

    def handle_exit(self, sig, frame) -> None:
        # Not recorded as uvicorn's own handler does: it would raise the signal again after a clean shutdown, and
        # the process would end by the signal instead of with 0. A second signal stops at once.
        if self.should_exit:
            self.force_exit = True
        self.engine.drain(self.shutdown_timeout)
        self.should_exit = True


def run_server(
    engine: Engine,
    *,
    host: str,
    port: int,
    model_name: str,
    shutdown_timeout: float,
    on_ready,
    stream_interval: float = 0.0,
) -> None:
    """Serve until SIGTERM or Ctrl-C; `on_ready(host, port)` once the socket listens (port 0: a free one)."""
    # The engine's thread and the event loop share the GIL: hand it over every 0.5 ms instead of 5, so that a busy
    # event loop cannot hold back the next decode step for long.
    sys.setswitchinterval(5e-4)
    app = create_app(engine, model_name=model_name, stream_interval=stream_interval)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=shutdown_timeout + 5
    )
    _Server(config, engine, shutdown_timeout, on_ready).run()
