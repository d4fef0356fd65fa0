"""The chunked LM head + cross-entropy on CUDA at the k3-scaled head size (skips without CUDA).

Run on a GPU machine: python -m pytest -q tests/gpu/ops/test_cross_entropy_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.cross_entropy import linear_cross_entropy
from tests.helpers import assert_as_accurate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N, D, V = 8 * 2048, 1024, 8192


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, D, device="cuda", generator=g)
    w = torch.randn(V, D, device="cuda", generator=g) / D**0.5
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    labels[::7] = -100
    return h, w, labels


def _step(fn, h, w, labels, autocast: bool):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels)
    loss.backward()
    torch.cuda.synchronize()
    return (loss.detach(), h.grad, w.grad), torch.cuda.max_memory_allocated() - base


def _plain(h, w, labels):
    return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)


def test_bf16_accuracy_and_memory():
    h, w, labels = _inputs()
    exact, _ = _step(_plain, h.double(), w.double(), labels, autocast=False)
    ours, ours_peak = _step(linear_cross_entropy, h, w, labels, autocast=True)
    plain, plain_peak = _step(_plain, h, w, labels, autocast=True)
    for name, a, e, p in zip(("loss", "dh", "dW"), ours, exact, plain, strict=True):
        assert_as_accurate(name, a, e, p)
    logits_f32 = N * V * 4
    # The plain form holds the float32 logits and more; ours h, dh, dW and a few chunk-sized blocks.
    assert plain_peak > logits_f32
    assert ours_peak < logits_f32, (ours_peak, logits_f32)


def test_compiled_matches_eager():
    h, w, labels = _inputs()
    eager, _ = _step(linear_cross_entropy, h, w, labels, autocast=True)
    compiled_fn = torch.compile(linear_cross_entropy, fullgraph=True)
    compiled, _ = _step(compiled_fn, h, w, labels, autocast=True)
    for name, a, b in zip(("loss", "dh", "dW"), compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4, msg=name)
