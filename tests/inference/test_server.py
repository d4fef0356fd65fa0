"""`hybrid-attention serve` as a user runs it: a server process on 127.0.0.1, real HTTP clients (httpx, and the
official openai client unchanged). Concurrent greedy completions that join and leave mid-batch each equal
`generate()` of their prompt alone; streaming; a client that leaves mid-stream frees its cache; bad parameters get a
4xx naming the field and the server keeps serving; a failing request gets a 500 and the rest go on; a full queue
gets 429 with Retry-After; SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from hybrid_attention.inference.generate import generate
from hybrid_attention.runs.checkpoint import load_run
from tests.inference.serving import FAULT_PROMPT, Server, metric, wait_for, write_run

pytest.importorskip("fastapi")  # the serve extra
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SERVER_ARGS = [
    "--device",
    "cpu",
    "--max-running",
    "4",
    "--max-queue",
    "16",
    "--max-batched-tokens",
    "48",
    "--max-prefill-chunk",
    "128",
    "--page-size",
    "8",
    "--max-context",
    "192",
    "--model-name",
    "tiny-test",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("serve") / "run")


@pytest.fixture(scope="module")
def server(run_dir):
    process = Server(["--ckpt", run_dir, *SERVER_ARGS])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model(run_dir):
    return load_run(run_dir)[0]


def expected_text(model, prompt: list[int], n: int) -> str:
    new = generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt) :].tolist()
    return bytes(new).decode("utf-8", errors="replace")


def test_concurrent_greedy_completions_each_equal_generate_alone(server, model):
    rng = random.Random(1)
    cases = []
    for i in range(8):
        length = rng.randint(1, 40)
        if i % 2:  # half as token ids, half as text (the byte tokenizer's ids are the UTF-8 bytes)
            prompt = [rng.randrange(0, 256) for _ in range(length)]
        else:
            prompt = [rng.randrange(32, 127) for _ in range(length)]
        cases.append((prompt, rng.randint(1, 24), rng.random() * 0.6, i % 2 == 0))

    async def one(client, prompt, n, delay, as_text):
        await asyncio.sleep(delay)  # arrivals spread out: later requests join a running batch
        body = {"prompt": bytes(prompt).decode() if as_text else prompt, "max_tokens": n, "temperature": 0}
        return await client.post(f"{server.url}/v1/completions", json=body)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, *case) for case in cases))

    for (prompt, n, _, _), response in zip(cases, asyncio.run(main()), strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "text_completion" and body["model"] == "tiny-test"
        (choice,) = body["choices"]
        assert choice["text"] == expected_text(model, prompt, n) and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def test_a_long_prompt_alone_prefills_in_large_chunks_and_equals_generate(server, model):
    """Nothing decodes beside it: chunks of --max-prefill-chunk (128 + 42), not of the 48-token iteration budget."""

    def chunks():
        return metric(httpx.get(f"{server.url}/metrics").text, "hybrid_attention_prefill_chunks_total")

    before = chunks()
    prompt = [random.Random(4).randrange(0, 256) for _ in range(170)]  # 48 tokens an iteration beside decoding
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected_text(model, prompt, 8)
    assert chunks() - before == 2


def test_the_openai_client_streams_and_lists_models(server, model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-test"]
    prompts = ["def add(a, b):", "Hello"]
    whole = client.completions.create(model="tiny-test", prompt=prompts, max_tokens=15, temperature=0)
    texts = {c.index: c.text for c in whole.choices}
    assert texts == {i: expected_text(model, list(p.encode()), 15) for i, p in enumerate(prompts)}
    assert whole.usage.completion_tokens == 30 and whole.usage.prompt_tokens == sum(len(p) for p in prompts)
    chunks = list(
        client.completions.create(
            model="tiny-test",
            prompt=prompts,
            max_tokens=15,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts and len(chunks) > 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-test", prompt="x", temperature=7)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")


def test_n_completions_per_prompt_in_openai_order(server, model):
    body = {"prompt": ["xyz", "ab"], "n": 3, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    assert texts == [expected_text(model, list(b"xyz"), 8)] * 3 + [expected_text(model, list(b"ab"), 8)] * 3
    assert answer["usage"] == {"prompt_tokens": 15, "completion_tokens": 48, "total_tokens": 63}
    # Sampled: copy j of a prompt draws with seed + j, so the first copy is the request with n = 1.
    sampled = {"prompt": "abc", "max_tokens": 12, "temperature": 1.5, "seed": 2**64 - 2}
    copies = httpx.post(f"{server.url}/v1/completions", json=dict(sampled, n=3), timeout=60).json()["choices"]
    for j, seed in enumerate([2**64 - 2, 2**64 - 1, 0]):  # seed + 2 wraps into the seed range
        (alone,) = httpx.post(f"{server.url}/v1/completions", json=dict(sampled, seed=seed), timeout=60).json()[
            "choices"
        ]
        assert copies[j]["text"] == alone["text"], (j, seed)


def test_seeded_sampling_is_repeatable_and_stop_strings_cut_the_text(server, model):
    body = {"prompt": "abc", "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 123}
    first, second = (httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    greedy = expected_text(model, list(b"xyz"), 20)
    stop = greedy[6:8]
    body = {"prompt": "xyz", "max_tokens": 20, "temperature": 0, "stop": [stop, "\x00never"]}
    (choice,) = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"]
    assert choice["text"] == greedy[: greedy.index(stop)] and choice["finish_reason"] == "stop"


BAD = [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": 0}, 400, "top_k"),
    ({"prompt": "x", "top_k": True}, 400, "top_k"),
    ({"prompt": "x", "seed": "7"}, 400, "seed"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": ["x"] * 40, "n": 2}, 400, "n=2"),
    ({"prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 256]}, 400, "prompt"),
    ({"prompt": [[1], [-1]]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x" * 192}, 400, "192 tokens"),
    ({"prompt": "x" * 100, "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
    ([1, 2], 400, "JSON object"),
]


def test_bad_parameters_get_a_4xx_naming_the_field_and_the_server_keeps_serving(server):
    with httpx.Client(timeout=30) as client:
        for body, status, needle in BAD:
            response = client.post(f"{server.url}/v1/completions", content=json.dumps(body))
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}, (body, error)
        garbage = client.post(f"{server.url}/v1/completions", content=b"{not json")
        assert garbage.status_code == 400 and "not valid JSON" in garbage.json()["error"]["message"]
        ok = client.post(f"{server.url}/v1/completions", json={"prompt": "still here", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert client.get(f"{server.url}/health").status_code == 200


def test_a_failing_request_gets_500_and_the_others_finish(server, model):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            url = f"{server.url}/v1/completions"
            return await asyncio.gather(
                client.post(url, json={"prompt": FAULT_PROMPT + [1, 2], "max_tokens": 5}),
                client.post(url, json={"prompt": "fine", "max_tokens": 12, "temperature": 0}),
            )

    failed, fine = asyncio.run(main())
    assert failed.status_code == 500 and "planted fault" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == expected_text(model, list(b"fine"), 12)
    assert "planted fault" in server.log()  # the traceback is logged


def test_a_client_that_leaves_mid_stream_frees_its_cache(server):
    def scrape():
        return httpx.get(f"{server.url}/metrics").text

    before = metric(scrape(), 'hybrid_attention_requests_ended_total{outcome="cancelled"}')
    body = {"prompt": "tell me everything", "max_tokens": 170, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        assert metric(scrape(), "hybrid_attention_cache_pages_in_use") > 0
    # The connection is closed after one event: the sequence must end and give back its pages and slot.
    wait_for(
        lambda: metric(scrape(), 'hybrid_attention_requests_ended_total{outcome="cancelled"}') > before,
        20,
        "the cancellation",
    )
    text = scrape()
    assert (
        metric(text, "hybrid_attention_cache_pages_in_use") == 0
        and metric(text, "hybrid_attention_running_sequences") == 0
    )
    assert (
        metric(text, "hybrid_attention_state_slots_in_use") == 0 and metric(text, "hybrid_attention_queue_depth") == 0
    )
    assert metric(text, "hybrid_attention_generated_tokens_total") > 0


@pytest.fixture(scope="module")
def small_server(run_dir):
    args = [
        "--ckpt",
        run_dir,
        "--device",
        "cpu",
        "--max-running",
        "1",
        "--max-queue",
        "2",
        "--max-batched-tokens",
        "16",
        "--page-size",
        "8",
        "--max-context",
        "400",
        "--shutdown-timeout",
        "20",
    ]
    process = Server(args)
    yield process
    process.stop()


def test_a_full_queue_gets_429_with_retry_after(small_server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "busy", "max_tokens": 80, "temperature": 0}
            return await asyncio.gather(
                *(client.post(f"{small_server.url}/v1/completions", json=body) for _ in range(8))
            )

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 3, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_sigterm_stops_admitting_finishes_what_runs_and_exits_zero(small_server):
    body = {"prompt": "last words", "max_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body, timeout=60) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    small_server.terminate()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"  # the running request was allowed to finish
    assert small_server.wait(timeout=30) == 0
    wait_for(lambda: "stopped;" in small_server.log(), 10, "the server's last log line")  # read by another thread
    log = small_server.log()
    assert "SIGTERM: taking no new requests; 1 running may finish" in log, log
    assert "stopped; requests by how they ended: 0 stop, " in log and "0 error" in log, log
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "late"}, timeout=5)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--ckpt", "{missing}", "--device", "cpu"], "no such run directory"),
        (
            ["serve", "--preset", "tiny", "--device", "cpu", "--max-context", "1000", "--num-pages", "2"],
            "fewer than one sequence of max_context=1000 tokens needs (16)",
        ),
    ],
)
def test_bad_serve_command_lines_end_in_one_line(argv, message, tmp_path, capsys):
    from tests.helpers import run_cli

    code, _, err = run_cli([a.format(missing=tmp_path / "missing") for a in argv], capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_stream_interval_spaces_the_chunks_and_loses_no_text():
    from hybrid_attention.inference.requests import Event
    from hybrid_attention.inference.server import _stream

    def end(cancel):
        assert not cancel, "nothing to cancel: every prompt ended"

    async def main(interval):
        queue = asyncio.Queue()

        async def produce():
            for i in range(30):
                await asyncio.sleep(0.003)
                queue.put_nowait((0, Event(str(i % 10), "length" if i == 29 else None, completion_tokens=30)))

        producer = asyncio.ensure_future(produce())
        loop, times, chunks = asyncio.get_running_loop(), [], []
        async for chunk in _stream(end, queue, 1, "cmpl-x", "m", False, interval):
            times.append(loop.time())
            chunks.append(chunk)
        await producer
        return times, chunks

    for interval in (0.0, 0.03):
        times, chunks = asyncio.run(main(interval))
        bodies = [json.loads(c[6:]) for c in chunks[:-1]]
        assert chunks[-1] == "data: [DONE]\n\n"
        assert "".join(b["choices"][0]["text"] for b in bodies) == "0123456789" * 3
        assert bodies[-1]["choices"][0]["finish_reason"] == "length"
        assert all(later - earlier >= interval - 1e-3 for earlier, later in zip(times[:-2], times[1:-1], strict=True))
        if interval:
            assert len(bodies) < 30
