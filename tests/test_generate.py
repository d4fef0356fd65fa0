"""Generation: greedy decoding with the cache equals recomputing the full forward; sampling controls; bad input."""

import pytest
import torch

from hybrid_attention.generate import generate_stream, sample_next_token
from hybrid_attention.model import HybridConfig, HybridLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = HybridConfig.from_preset("tiny", kda_backend="torch")
    m = HybridLM(cfg).double().eval()
    for name, p in m.named_parameters():  # non-trivial AttnRes mixing
        if name.endswith(".query"):
            p.data.normal_()
    return m


def test_greedy_generation_equals_full_recompute(model):
    prompt = torch.randint(0, 256, (2, 7))
    out = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert out.shape == (2, 19) and torch.equal(out[:, :7], prompt)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(out, ids)


def test_sampling_is_seeded_and_top_k_one_is_greedy(model):
    prompt = torch.randint(0, 256, (1, 5))
    a = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    greedy = model.generate(prompt, 10, temperature=0)
    assert torch.equal(model.generate(prompt, 10, temperature=0.7, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, 10, temperature=0.7, top_p=1e-9), greedy)


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
    first = model.generate(prompt, 1, temperature=0)[0, -1].item()
    out = model.generate(prompt, 20, temperature=0, eos_token_id=first)
    assert out.shape == (1, 5)
    assert len(list(generate_stream(model, prompt, 0))) == 0


def test_bad_generation_input(model):
    with pytest.raises(ValueError, match="non-empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="token ids"):
        model.generate(torch.full((1, 3), 256), 2)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, top_p=1.5)
