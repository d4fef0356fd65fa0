"""Limits on a CUDA GPU: the card's memory bounds a cache before it is made, and logits that are not finite stop
generation at the first token (the one check a CUDA decode loop pays a host sync for).
Run: `python -m pytest -q tests/gpu/inference/test_limits_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention import machine
from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.generate import generate
from hybrid_attention.model import HybridLM
from tests.helpers import needs_cuda

pytestmark = needs_cuda


def test_the_cards_memory_bounds_a_cache():
    total = torch.cuda.get_device_properties(0).total_memory
    assert machine.memory_bytes("cuda") == total
    model = HybridLM(HybridConfig.from_preset("k3-scaled")).cuda().to(torch.bfloat16)
    per_token = model.cache_bytes_per_token(torch.bfloat16)
    name = torch.cuda.get_device_name(0)
    with pytest.raises(ValueError, match=f"more than the .* on the {name}"):
        model.make_cache(1, total // per_token + 1)
    assert model.make_cache(2, 4096).max_seq_len == 4096


def test_logits_that_are_not_finite_stop_at_the_first_token():
    model = HybridLM(HybridConfig.from_preset("tiny")).cuda()
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)
    prompt = torch.tensor([[100, 101, 102]], device="cuda")
    with pytest.raises(ValueError, match="the logits for new token 1 hold NaN or infinite values"):
        generate(model, prompt, 4, temperature=0.8)
