"""The serving engine in this process (CPU, float32): requests that join and leave mid-batch each equal `generate()`
of their prompt alone; stop strings; seeded sampling; cancellation and failures free their pages and slots and leave
the other requests alone."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.data.tokenizer import ByteTokenizer
from hybrid_attention.inference.engine import Engine
from hybrid_attention.inference.engine_config import EngineConfig
from hybrid_attention.inference.generate import generate
from hybrid_attention.inference.requests import Request, SamplingParams
from hybrid_attention.inference.scheduler import QueueFull
from hybrid_attention.model import HybridLM

LIMITS = dict(max_running=4, max_prefilling=2, max_batched_tokens=24, page_size=8, max_context=96, max_queue=32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HybridLM(HybridConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)  # well-separated logits: greedy tokens do not hinge on rounding
    return m


def make_engine(model, **overrides) -> Engine:
    return Engine(model, ByteTokenizer(), EngineConfig(**{**LIMITS, **overrides}))


def submit(engine, prompt, events, **params):
    request = Request(list(prompt), SamplingParams(**params), events.append)
    engine.submit([request])
    return request


def run_until_idle(engine, limit=2000):
    for _ in range(limit):
        if engine.idle():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def reference(model, prompt, n):
    return generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt) :].tolist()


def test_joining_and_leaving_requests_each_equal_generate_alone(model):
    engine = make_engine(model)
    g = torch.Generator().manual_seed(3)
    specs = [
        (int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))) for _ in range(9)
    ]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n, _ in specs]
    requests, events = [], []
    for wave in (prompts[:3], prompts[3:6], prompts[6:]):  # later waves join while earlier ones decode
        for prompt in wave:
            i = len(requests)
            requests.append(submit(engine, prompt, events, max_tokens=specs[i][1], temperature=0))
        for _ in range(3):
            engine.step()
    run_until_idle(engine)
    for i, request in enumerate(requests):
        assert request.tokens == reference(model, prompts[i], specs[i][1]), f"request {i} ({specs[i]})"
        assert request.finished
    finals = [e for e in events if e.final]
    assert len(finals) == 9 and all(e.finish_reason == "length" and e.error is None for e in finals)
    assert engine.stats()["pages_used"] == 0 and engine.stats()["slots_used"] == 0
    assert engine.stats()["generated_tokens"] == sum(n for _, n in specs)


def test_stop_strings_end_the_text_before_them(model):
    engine = make_engine(model)
    prompt = list(b"def f(x):")
    full = bytes(reference(model, prompt, 12)).decode("utf-8", errors="replace")
    stop = full[5:7]
    events = []
    request = submit(engine, prompt, events, max_tokens=12, temperature=0, stop=(stop, "\x00never"))
    run_until_idle(engine)
    text = "".join(e.text for e in events)
    assert text == full[: full.index(stop)] and events[-1].finish_reason == "stop"
    assert len(request.tokens) < 12 and engine.stats()["pages_used"] == 0


def test_seeded_sampling_repeats_and_stays_in_the_vocabulary(model):
    engine = make_engine(model)
    runs = []
    for _ in range(2):
        events = []
        request = submit(engine, [1, 2, 3], events, max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7)
        run_until_idle(engine)
        runs.append(request.tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 10 and all(0 <= t < 256 for t in runs[0])


def test_cancellation_and_failures_free_their_cache_and_spare_the_rest(model):
    engine = make_engine(model)
    real, real_packed = engine.prefill_chunk, engine.prefill_packed

    def fault(request, slot, start, end):
        if request.prompt[0] == 255:
            raise RuntimeError("injected fault")
        return real(request, slot, start, end)

    def packed_fault(chunks):  # the packed forward fails as a whole: each prompt then runs alone
        if any(chunk.seq.owner.prompt[0] == 255 for chunk in chunks):
            raise RuntimeError("injected fault")
        return real_packed(chunks)

    engine.prefill_chunk, engine.prefill_packed = fault, packed_fault
    events = {name: [] for name in ("bad", "cancelled", "good")}
    bad = submit(engine, [255, 1, 2], events["bad"], max_tokens=5, temperature=0)
    gone = submit(engine, list(range(30)), events["cancelled"], max_tokens=40, temperature=0)
    good = submit(engine, [5, 6, 7, 8], events["good"], max_tokens=9, temperature=0)
    for _ in range(4):
        engine.step()
    assert engine.stats()["pages_used"] > 0
    engine.cancel([gone])
    run_until_idle(engine)
    assert events["bad"][-1].error and "injected fault" in events["bad"][-1].error and events["bad"][-1].status == 500
    assert bad.finished and gone.finished and not any(e.final for e in events["cancelled"])
    assert good.tokens == reference(model, [5, 6, 7, 8], 9)
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and stats["queue_depth"] == 0
    assert stats["finished_error"] == 1 and stats["finished_cancelled"] == 1 and stats["finished_length"] == 1


def test_a_prompt_alone_prefills_in_few_chunks_and_beside_decoding_ones_in_bounded_chunks(model):
    engine = make_engine(model, max_context=400, max_prefill_chunk=256)
    spans, real = [], engine.prefill_chunk

    def spy(request, slot, start, end):
        spans.append((request.prompt[0], start, end, len(engine.scheduler.decoding)))
        return real(request, slot, start, end)

    engine.prefill_chunk = spy
    g = torch.Generator().manual_seed(5)
    long = [7] + torch.randint(0, 256, (300,), generator=g).tolist()
    alone = submit(engine, long, [], max_tokens=6, temperature=0)
    run_until_idle(engine)
    assert [(start, end) for _, start, end, _ in spans] == [(0, 256), (256, 301)]
    assert alone.tokens == reference(model, long, 6)
    spans.clear()
    short = submit(engine, [1, 2, 3], [], max_tokens=40, temperature=0)
    while not engine.scheduler.decoding:
        engine.step()
    other = [9] + torch.randint(0, 256, (70,), generator=g).tolist()
    beside = submit(engine, other, [], max_tokens=5, temperature=0)
    run_until_idle(engine)
    chunks = [(start, end, decoding) for first, start, end, decoding in spans if first == 9]
    assert len(chunks) == 3 and chunks[-1][1] == len(other)
    for start, end, decoding in chunks:  # 24 prompt tokens an iteration, a chunk that goes on ends on a page
        assert decoding >= 1 and end - start <= 24 and (end == len(other) or end % 8 == 0)
    assert beside.tokens == reference(model, other, 5) and short.tokens == reference(model, [1, 2, 3], 40)


def test_limits_refuse_what_cannot_fit(model):
    engine = make_engine(model, max_queue=2)
    with pytest.raises(ValueError, match="context is 96 tokens, but the request asks for 100"):
        submit(engine, [1] * 90, [], max_tokens=10)
    submit(engine, [1], [], max_tokens=2)
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit([Request([1], SamplingParams(), print), Request([2], SamplingParams(), print)])
    assert engine.stats()["queue_depth"] == 1


def test_the_iteration_budget_follows_the_device_unless_set():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig().batched_tokens(gpu) > EngineConfig().batched_tokens(cpu) > 0
    assert EngineConfig(max_batched_tokens=300).batched_tokens(gpu) == 300
    with pytest.raises(ValueError, match="max_batched_tokens=0"):
        EngineConfig(max_batched_tokens=0)
