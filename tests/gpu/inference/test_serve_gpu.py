"""The serving engine and server on a CUDA GPU, decoding from CUDA graphs captured at bucketed batch sizes over the
paged cache: requests that join and leave mid-batch each equal `generate()` alone (float32, k3-scaled and all-MLA);
in bf16 every decode step's logits are as accurate against float64 as the bf16 full forward; the server process on
CUDA answers concurrent requests as `generate()` does and gives back every page.
Run: `python -m pytest -q tests/gpu/inference/test_serve_gpu.py`."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from hybrid_attention.inference.engine import Engine
from hybrid_attention.inference.engine_config import EngineConfig
from hybrid_attention.inference.generate import generate
from hybrid_attention.inference.requests import Request, SamplingParams
from hybrid_attention.ops.backends import use_reference
from tests.gpu.inference.test_generate_gpu import K3_BLOCK, float64_copy, make_model, no_tf32  # noqa: F401
from tests.helpers import assert_as_accurate, needs_cuda

pytestmark = needs_cuda
LIMITS = dict(max_running=8, max_prefilling=2, max_batched_tokens=256, page_size=64, max_context=1024, max_queue=64)
CASES = [(1, 9), (5, 30), (63, 12), (64, 40), (65, 7), (200, 25), (300, 33), (17, 1), (129, 18), (2, 40), (700, 5)]


class Tokens:
    """A tokenizer for random-weight models of any vocabulary: token i is the byte i % 256."""

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id % 256])


def run_waves(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[Request]:
    """Submit the requests in three waves a few iterations apart (later ones join a running batch), run to the end."""
    requests = [
        Request(p, SamplingParams(max_tokens=n, temperature=0), lambda e: None)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    third = len(requests) // 3 + 1
    for start in range(0, len(requests), third):
        engine.submit(requests[start : start + third])
        for _ in range(4):
            engine.step()
    for _ in range(5000):
        if engine.idle():
            break
        engine.step()
    assert engine.idle() and engine.stats()["pages_used"] == 0 and engine.stats()["slots_used"] == 0
    return requests


def random_prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n, _ in CASES]


@pytest.mark.parametrize("preset", ["k3-scaled", "k3-scaled-all-mla"])
def test_engine_under_cuda_graphs_equals_generate_alone_float32(preset):
    model = make_model(preset, torch.float32, seed=4)
    engine = Engine(model, Tokens(), EngineConfig(**LIMITS))
    engine.warm_up()
    assert set(engine.steps) == set(engine.batch_sizes) and all(s.graph is not None for s in engine.steps.values())
    prompts = random_prompts(model.config.vocab_size, seed=5)
    requests = run_waves(engine, prompts, [n for _, n in CASES])
    for request, prompt, (_, n) in zip(requests, prompts, CASES, strict=True):
        alone = generate(model, torch.tensor([prompt], device="cuda"), n, temperature=0)[0, len(prompt) :].tolist()
        assert request.tokens == alone, f"{preset}: prompt of {len(prompt)} tokens differs from generate() alone"


def test_engine_bf16_logits_as_accurate_as_the_full_forward():
    """bf16 batching changes GEMM shapes and so rounding (greedy tokens may part on near-ties): each decode step's
    logits, in whatever batch it ran, are as accurate against float64 as the sequence's own bf16 full forward."""
    model = make_model("k3-scaled", torch.bfloat16, seed=6, layer_types=K3_BLOCK)
    engine = Engine(model, Tokens(), EngineConfig(**LIMITS))
    engine.warm_up()
    seen = defaultdict(list)
    sample = engine._sample

    def recording(logits, requests):
        for row, request in enumerate(requests):
            seen[id(request)].append(logits[row].float().clone())
        return sample(logits, requests)

    engine._sample = recording
    prompts = random_prompts(model.config.vocab_size, seed=7)
    requests = run_waves(engine, prompts, [n for _, n in CASES])
    ref_model = float64_copy(model)
    for request, prompt in zip(requests, prompts, strict=True):
        logits = torch.stack(seen[id(request)])  # one row per sampled token: the prefill's, then each decode step's
        assert logits.shape[0] == len(request.tokens) and request.tokens == logits.argmax(-1).tolist()
        seq = torch.tensor([prompt + request.tokens[:-1]], device="cuda")
        at = slice(len(prompt) - 1, None)
        with torch.no_grad():
            full = model(seq).logits[0, at].float()
            with use_reference():
                ref = ref_model(seq).logits[0, at]
        assert_as_accurate(f"served bf16 logits, prompt of {len(prompt)}", logits, ref, full)


def test_server_process_on_cuda_equals_generate(tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import asyncio

    from hybrid_attention.runs.checkpoint import load_run
    from tests.inference.serving import Server, metric, write_run

    run = write_run(tmp_path / "run")
    server = Server(
        [
            "--ckpt",
            run,
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--max-running",
            "8",
            "--max-batched-tokens",
            "64",
            "--page-size",
            "16",
            "--max-context",
            "512",
        ]
    )
    try:
        model = load_run(run, "cuda")[0]
        g = torch.Generator().manual_seed(8)
        cases = [
            (torch.randint(0, 256, (int(n),), generator=g).tolist(), int(m)) for n, m in torch.randint(1, 90, (16, 2))
        ]

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                url = f"{server.url}/v1/completions"
                posts = [client.post(url, json={"prompt": p, "max_tokens": m, "temperature": 0}) for p, m in cases]
                return await asyncio.gather(*posts)

        for (prompt, m), response in zip(cases, asyncio.run(main()), strict=True):
            assert response.status_code == 200, response.text
            new = generate(model, torch.tensor([prompt], device="cuda"), m, temperature=0)[0, len(prompt) :]
            assert response.json()["choices"][0]["text"] == bytes(new.tolist()).decode("utf-8", errors="replace")
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "hybrid_attention_cache_pages_in_use") == 0
        assert metric(text, "hybrid_attention_generated_tokens_total") == sum(m for _, m in cases)
        server.terminate()
        assert server.wait(timeout=60) == 0
    finally:
        server.stop()
