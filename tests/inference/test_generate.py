"""Generation: greedy decoding with the cache equals recomputing the full forward; sampling controls; batched
prompts of different lengths (list or padded with a mask) equal one-at-a-time generation; chunked prefill; the eager
decode step; bad input. (CUDA-graph decoding is tested in tests/gpu/inference/test_generate_gpu.py.)"""

import copy

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.generate import generate, generate_stream, sample_next_token
from hybrid_attention.inference.prefill import prefill
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = HybridConfig.from_preset("tiny")
    m = HybridLM(cfg, kda_backend="torch").double().eval()
    for name, p in m.named_parameters():  # non-trivial AttnRes mixing
        if name.endswith(".query"):
            p.data.normal_()
    return m


def test_greedy_generation_equals_full_recompute(model):
    prompt = torch.randint(0, 256, (2, 7))
    out = generate(model, prompt, max_new_tokens=12, temperature=0)
    assert out.shape == (2, 19) and torch.equal(out[:, :7], prompt)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(out, ids)


def test_sampling_is_seeded_and_top_k_one_is_greedy(model):
    prompt = torch.randint(0, 256, (1, 5))
    a = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    greedy = generate(model, prompt, 10, temperature=0)
    assert torch.equal(generate(model, prompt, 10, temperature=0.7, top_k=1), greedy)
    assert torch.equal(generate(model, prompt, 10, temperature=0.7, top_p=1e-9), greedy)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next_token(logits, 1.0, top_k=2, generator=gen).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: top_p=0.8 keeps the first two tokens
    assert probs[0] < 0.8 < probs[0] + probs[1]
    assert set(sample_next_token(logits, 1.0, top_p=0.8, generator=gen).tolist()) == {0, 1}
    assert set(sample_next_token(logits, 1.0, generator=gen).tolist()) == {0, 1, 2, 3, 4}


def test_eos_stops_generation(model):
    prompt = torch.randint(0, 256, (1, 4))
    first = generate(model, prompt, 1, temperature=0)[0, -1].item()
    out = generate(model, prompt, 20, temperature=0, eos_token_id=first)
    assert out.shape == (1, 5)
    assert len(list(generate_stream(model, prompt, 0))) == 0


def test_bad_generation_input(model):
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, torch.full((1, 3), 256), 2)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, top_p=1.5)


def _singles(model, prompts, n, **kw):
    return [generate(model, p[None], n, temperature=0, **kw)[0] for p in prompts]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_prompts_of_different_lengths_equal_one_at_a_time(model, dtype):
    m = copy.deepcopy(model).to(dtype)
    prompts = [torch.randint(0, 256, (n,)) for n in (5, 1, 17, 12)]
    batched = generate(m, prompts, 9, temperature=0)
    assert isinstance(batched, list) and len(batched) == 4
    for b, (out, ref) in enumerate(zip(batched, _singles(m, prompts, 9), strict=True)):
        assert torch.equal(out, ref), f"prompt {b}: batched tokens differ from one-at-a-time generation"


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_with_attention_mask(model, side):
    prompts = [torch.randint(0, 256, (n,)) for n in (6, 11, 2)]
    T = 11
    ids = torch.full((3, T), 7)  # a real token id as padding: the mask alone must keep it out
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[b, cols], mask[b, cols] = p, 1
    out = generate(model, ids, 8, temperature=0, attention_mask=mask)
    assert out.shape == (3, T + 8) and torch.equal(out[:, :T], ids)
    for b, ref in enumerate(_singles(model, prompts, 8)):
        assert torch.equal(out[b, T:], ref[len(prompts[b]) :]), f"row {b} ({side} padding)"
    # A mask of ones is the plain batch.
    full = generate(model, ids, 4, temperature=0, attention_mask=torch.ones_like(mask))
    assert torch.equal(full, generate(model, ids, 4, temperature=0))


def test_batched_eos_and_streaming(model):
    prompts = [torch.randint(0, 256, (n,)) for n in (3, 8)]
    first = _singles(model, prompts, 1)
    eos = int(first[0][-1])  # prompt 0 stops at once; prompt 1 keeps going (unless it happens to pick eos too)
    steps = list(generate_stream(model, prompts, 6, temperature=0, eos_token_id=eos))
    assert all(s.shape == (2,) for s in steps)
    assert all(int(s[0]) == eos for s in steps)
    alone = _singles(model, prompts[1:], 6)[0][8:]
    stream = torch.stack(steps)[:, 1]
    assert torch.equal(stream, alone[: len(stream)])


def test_chunked_prefill_is_exact(model):
    ids = torch.randint(0, 256, (2, 29))
    whole = model.make_cache(2, 30)
    chunked = model.make_cache(2, 30)
    a = prefill(model, ids, whole, chunk_size=None)
    b = prefill(model, ids, chunked, chunk_size=4)  # 7 chunks of 4 and one of 1 (the one-token decode path)
    assert_close("last logits", b, a, 1e-10)
    assert chunked.seq_len == whole.seq_len == 29
    for x, y in zip(whole.layers, chunked.layers, strict=True):
        for name in ("rows", "state", "conv_q", "conv_k", "conv_v"):
            if hasattr(x, name):
                ref = getattr(x, name)[:, :29] if name == "rows" else getattr(x, name)
                got = getattr(y, name)[:, :29] if name == "rows" else getattr(y, name)
                assert_close(f"cache {name}", got, ref, 1e-10)
    out = generate(model, ids, 6, temperature=0, prefill_chunk_size=5)
    assert torch.equal(out, generate(model, ids, 6, temperature=0))
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(model, ids, model.make_cache(2, 30), chunk_size=0)


def test_decode_step_eager_equals_model_forward(model):
    """DecodeStep without a graph (what runs on CPU) is the plain model forward on the static buffers."""
    ids = torch.randint(0, 256, (2, 12))
    cache = model.make_cache(2, 12)
    step = DecodeStep(model, cache, cuda_graph=False)
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :6], cache=cache)
        outs = [step(ids[:, t]) for t in range(6, 12)]
    assert_close("decode steps", torch.stack(outs, dim=1), full[:, 6:], 1e-10)
    assert cache.seq_len == 12
    with pytest.raises(ValueError, match="cache is full"):
        step(ids[:, 0])
    with pytest.raises(ValueError, match=r"tokens of shape \[2\]"):
        step(ids[:1, 0])
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeStep(model, model.make_cache(1, 4), cuda_graph=True)
    with pytest.raises(ValueError, match="no CUDA graph"):
        DecodeStep(model, model.make_cache(1, 4), cuda_graph=False).replay()


def test_cache_snapshot_restore_undoes_decoding(model):
    """What DecodeStep's capture relies on to build on a prefilled cache: after `restore`, decoding continues exactly
    as if the steps since `snapshot` had never run (KDA states, conv tails and lengths are back; MLA rows past the
    lengths are overwritten before they are read)."""
    ids = torch.randint(0, 256, (2, 13))
    cache = model.make_cache(2, 16)
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :9], cache=cache)
        saved = cache.snapshot()
        model(torch.randint(0, 256, (2, 3)), cache=cache)  # steps to undo
        assert cache.seq_len == 12
        cache.restore(saved)
        assert cache.host_lengths == [9, 9]
        assert cache.lengths.tolist() == [9, 9]
        rest = model(ids[:, 9:], cache=cache).logits
    assert_close("decoding after restore", rest, full[:, 9:], 1e-10)
    with pytest.raises(ValueError, match="another shape"):
        model.make_cache(1, 16).restore(saved)


def test_bad_batched_input(model):
    ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(ValueError, match="cuda_graph=True"):
        generate(model, ids, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="attention_mask shape"):
        generate(model, ids, 3, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="holes"):
        generate(model, ids, 3, attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="all padding"):
        generate(model, ids, 3, attention_mask=torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="only 0"):
        generate(model, ids, 3, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="list of prompts is empty"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty 1-D"):
        generate(model, [ids[0], ids[1, :0]], 3)
    with pytest.raises(ValueError, match="not a list"):
        generate(model, [ids[0]], 3, attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [ids[0], torch.tensor([1, 300])], 3)
