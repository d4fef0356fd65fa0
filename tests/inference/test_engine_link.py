"""The pipe between the engine's process and the HTTP process, both ends in this process over a real pipe, with a
stand-in engine: submissions, refusals, cancellation and counts cross it; events that pile up while the pipe is
busy reach the HTTP side merged per request, in order, none lost; the HTTP side learns when the engine is gone.
And the stream chunks' template encodes what `chunk_body` does."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading

import pytest

from hybrid_attention.inference.engine_link import EngineClient, EngineHost
from hybrid_attention.inference.openai_api import ChunkEncoder, chunk_body
from hybrid_attention.inference.requests import Event, SamplingParams
from hybrid_attention.inference.scheduler import QueueFull, ShuttingDown


class StandInEngine:
    def __init__(self):
        self.submitted, self.cancelled, self.refuse = [], [], None
        self.deliver = None  # set by EngineHost

    def submit(self, requests):
        if self.refuse:
            raise self.refuse
        self.submitted.append(requests)

    def cancel(self, requests):
        self.cancelled.append(requests)

    def stats(self):
        return {"running": len(self.submitted)}


class GatedConn:
    """A pipe end whose sends wait for `gate` (the HTTP side busy), recording what is sent."""

    def __init__(self):
        self.gate, self.sent, self.sending = threading.Event(), [], threading.Event()

    def send(self, batch):
        self.sending.set()
        self.gate.wait(10)
        self.sent.append(batch)

    def recv(self):
        raise EOFError


def test_events_that_wait_for_a_busy_pipe_are_merged_per_request_in_order():
    engine, conn = StandInEngine(), GatedConn()
    host = EngineHost(engine, conn)
    host._submit(7, [[1, 2], [3]], [SamplingParams(max_tokens=4)] * 2)
    (first, second) = engine.submitted[0]
    assert conn.sending.wait(5)  # the submission's reply is being sent, and the pipe is busy
    engine.deliver([(first, Event("a")), (second, Event("x"))])
    engine.deliver([(first, Event("b"))])
    engine.deliver([(first, Event("c", "length", prompt_tokens=2, completion_tokens=3)), (second, Event("y"))])
    conn.gate.set()
    host.close()
    assert conn.sent[0] == [("reply", 7, None)]
    events = {k: Event(*e) for batch in conn.sent[1:] for kind, _, v in batch if kind == "events" for k, e in v.items()}
    assert len(conn.sent) == 2, conn.sent  # three deliveries, one message
    assert events[7, 0] == Event("abc", "length", prompt_tokens=2, completion_tokens=3) and events[7, 1].text == "xy"
    assert 7 in host._open and host._open[7] == 1  # the second prompt has not ended


def test_submit_refuse_cancel_count_and_events_cross_a_real_pipe():
    engine = StandInEngine()
    ours, theirs = multiprocessing.Pipe()
    host = EngineHost(engine, ours)
    ready = []
    serving = threading.Thread(target=host.serve, args=(lambda *a: ready.append(a),), daemon=True)
    serving.start()

    async def main():
        client = EngineClient(theirs)
        client.attach(asyncio.get_running_loop())
        client.ready("127.0.0.1", 1234)
        key, queue = await client.submit([[5, 6, 7]], [SamplingParams(max_tokens=3)])
        (request,) = engine.submitted[0]
        assert request.prompt == [5, 6, 7] and (await client.stats()) == {"running": 1}
        for piece in ("he", "ll", "o"):
            engine.deliver([(request, Event(piece))])
        engine.deliver([(request, Event("!", "length", completion_tokens=3))])
        text, final = "", None
        while final is None:
            index, event = await asyncio.wait_for(queue.get(), 5)
            assert index == 0
            text += event.text
            final = event.finish_reason
        assert text == "hello!" and final == "length"
        client.close(key, cancel=False)
        engine.refuse = QueueFull("the queue is full")
        with pytest.raises(QueueFull, match="queue is full"):
            await client.submit([[1]], [SamplingParams()])
        engine.refuse = None
        key, queue = await client.submit([[1], [2]], [SamplingParams()] * 2)
        client.close(key, cancel=True)
        for _ in range(100):
            if engine.cancelled:
                break
            await asyncio.sleep(0.01)
        assert [r.prompt for r in engine.cancelled[0]] == [[1], [2]]
        theirs.close()  # the HTTP process ends: the engine side's serve returns

    asyncio.run(main())
    serving.join(5)
    assert ready == [("127.0.0.1", 1234)] and not serving.is_alive()


def test_the_http_side_ends_what_waits_when_the_engine_is_gone():
    ours, theirs = multiprocessing.Pipe()

    async def main():
        client = EngineClient(theirs)
        client.attach(asyncio.get_running_loop())
        client._queues[1] = queue = asyncio.Queue()  # a submission in flight
        waiting = asyncio.ensure_future(client.stats())
        await asyncio.sleep(0)  # the question is sent
        shut = []
        client.on_shutdown = shut.append
        ours.close()  # the engine's process is gone
        index, event = await asyncio.wait_for(queue.get(), 5)
        assert event.error and event.status == 503 and client.draining and shut == [True]
        with pytest.raises(ShuttingDown, match="engine has stopped"):
            await waiting
        with pytest.raises(ShuttingDown, match="engine has stopped"):
            await client.submit([[1]], [SamplingParams()])

    asyncio.run(main())


@pytest.mark.parametrize("include_usage", [False, True])
def test_the_chunk_template_encodes_what_chunk_body_does(include_usage):
    encoder = ChunkEncoder("cmpl-1", 'model "q"', include_usage=include_usage)
    choices = [(0, 'he said "hi"\n\u00e9\ufffd', None), (3, "", "length")]
    body = json.loads(encoder.encode(choices).removeprefix("data: "))
    expected = chunk_body("cmpl-1", 'model "q"', choices, include_usage=include_usage)
    assert abs(body.pop("created") - expected.pop("created")) <= 1 and body == expected
    assert encoder.encode(choices).endswith("}\n\n")
