"""The pipe between the serving engine's process and the HTTP process (docs/inference.md, "Serving"): the HTTP side
submits prompts, cancels them and asks for counts; the engine side answers and sends each request's events, merged
per request while the pipe is busy, so a slow HTTP side gets fewer, larger events instead of holding up the engine.
Torch-free: the HTTP process imports it.

Messages, each a tuple (kind, key, value), the engine side sending lists of them:
HTTP -> engine: ("submit", key, (prompts, params)), ("cancel", key, None), ("stats", key, None), ("ready", 0, (host,
port)); engine -> HTTP: ("reply", key, value or exception), ("events", 0, {(key, index): the fields of an Event}),
("shutdown", 0, force). Events cross as tuples of their fields: plain tuples pickle in C, a dataclass through
`__reduce_ex__`, once per object.
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial

from hybrid_attention.inference.requests import Event, Request, SamplingParams
from hybrid_attention.inference.scheduler import QueueFull, ShuttingDown

REFUSALS = (QueueFull, ShuttingDown, ValueError)  # what a submission may be refused with (the HTTP side maps them)


class EngineHost:
    """The engine's end: `serve` (the main thread) applies what the HTTP side sends to `engine`; a sender thread
    sends replies and events. The engine's `deliver` is routed here."""

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self._lock = threading.Condition()
        self._replies: list[tuple] = []
        self._events: dict[tuple[int, int], tuple] = {}  # Event fields, merged while the pipe is busy
        self._requests: dict[int, list[Request]] = {}  # submissions with prompts still running
        self._open: dict[int, int] = {}  # their prompts without a final event yet
        self._closed = False
        engine.deliver = self._deliver
        self._sender = threading.Thread(target=self._send_loop, name="hybrid-attention-link", daemon=True)
        self._sender.start()

    def serve(self, on_ready) -> None:
        """Until the HTTP side closes its end: submissions, cancellations, counts; `on_ready(host, port)` once it
        listens."""
        while True:
            try:
                kind, key, value = self.conn.recv()
            except (EOFError, OSError):
                return
            if kind == "submit":
                self._submit(key, *value)
            elif kind == "cancel":
                with self._lock:
                    requests = self._requests.pop(key, [])
                    self._open.pop(key, None)
                self.engine.cancel(requests)
            elif kind == "stats":
                self._post(("reply", key, self.engine.stats()))
            elif kind == "ready":
                on_ready(*value)

    def shutdown(self, *, force: bool) -> None:
        """Tell the HTTP side to stop taking connections (force: at once, without waiting for open ones)."""
        self._post(("shutdown", 0, force))

    def close(self) -> None:
        """Send what is left, then stop the sender."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._sender.join(timeout=10)

    def _submit(self, key: int, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        requests = [
            Request(ids, p, partial(self._merge, key, i), index=i)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        with self._lock:  # before the engine can deliver anything for them
            self._requests[key], self._open[key] = requests, len(requests)
        try:
            self.engine.submit(requests)
        except REFUSALS as exc:
            with self._lock:
                del self._requests[key], self._open[key]
            self._post(("reply", key, exc))
            return
        self._post(("reply", key, None))

    def _deliver(self, items: list[tuple[Request, Event]]) -> None:
        """The engine's thread, once per iteration: its events, merged into what waits to be sent."""
        with self._lock:
            for request, event in items:
                request.sink(event)
            self._lock.notify()

    def _merge(self, key: int, index: int, event: Event) -> None:  # under self._lock
        """After an earlier event of the same prompt that has not been sent: one event, the texts joined."""
        earlier = self._events.get((key, index))
        text = event.text if earlier is None else earlier[0] + event.text
        e = event
        self._events[key, index] = (text, e.finish_reason, e.error, e.status, e.prompt_tokens, e.completion_tokens)
        if event.final and key in self._open:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key], self._requests[key]

    def _post(self, message: tuple) -> None:
        with self._lock:
            self._replies.append(message)
            self._lock.notify()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not (self._replies or self._events or self._closed):
                    self._lock.wait()
                batch = self._replies + ([("events", 0, self._events)] if self._events else [])
                self._replies, self._events, closed = [], {}, self._closed
            try:
                if batch:
                    self.conn.send(batch)
            except (OSError, ValueError):  # the HTTP side is gone
                return
            if closed:
                return


class EngineClient:
    """The HTTP side's end, on its event loop (`attach`): `submit` gives a queue of (index, Event) per submission;
    `close` ends one (cancelling its prompts when they still run); `stats` the engine's counts."""

    def __init__(self, conn):
        self.conn = conn
        self.draining = False
        self._gone = False  # the engine's end of the pipe closed
        self.on_shutdown = lambda force: None  # set by the server: stop taking connections
        self._next_key = 0
        self._queues: dict[int, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.conn.fileno(), self._readable)

    def ready(self, host: str, port: int) -> None:
        self.conn.send(("ready", 0, (host, port)))

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, asyncio.Queue]:
        """prompts and their sampling settings, one each -> (key, queue of (index, Event)); raises what the engine
        refused them with (`REFUSALS`)."""
        key, queue = self._key(), asyncio.Queue()
        self._queues[key] = queue
        refused = await self._call("submit", key, (prompts, params))
        if refused is not None:
            del self._queues[key]
            raise refused
        return key, queue

    def close(self, key: int, *, cancel: bool) -> None:
        if self._queues.pop(key, None) is not None and cancel and not self._gone:
            self.conn.send(("cancel", key, None))

    async def stats(self) -> dict:
        return await self._call("stats", self._key(), None)

    def _key(self) -> int:
        self._next_key += 1
        return self._next_key

    async def _call(self, kind: str, key: int, value):
        if self._gone:
            raise ShuttingDown("the engine has stopped")
        future = self._loop.create_future()
        self._calls[key] = future
        self.conn.send((kind, key, value))
        return await future

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                for kind, key, value in self.conn.recv():
                    self._handle(kind, key, value)
        except (EOFError, OSError):  # the engine's process is gone: end everything
            self._loop.remove_reader(self.conn.fileno())
            self._lost()

    def _handle(self, kind: str, key: int, value) -> None:
        if kind == "reply":
            future = self._calls.pop(key, None)
            if future is not None and not future.done():
                future.set_result(value)
        elif kind == "events":
            for (owner, index), fields in value.items():
                queue = self._queues.get(owner)
                if queue is not None:  # else its client has gone
                    queue.put_nowait((index, Event(*fields)))
        elif kind == "shutdown":
            self.draining = True
            self.on_shutdown(value)

    def _lost(self) -> None:
        self.draining = self._gone = True
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ShuttingDown("the engine has stopped"))
        for queue in self._queues.values():
            queue.put_nowait((0, Event(error="the engine has stopped", status=503)))
        self._calls, self._queues = {}, {}
        self.on_shutdown(True)
