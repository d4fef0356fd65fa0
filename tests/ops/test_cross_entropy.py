"""The chunked linear + cross-entropy op against F.cross_entropy(F.linear(h, W), labels): loss, dh, dW."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.cross_entropy import linear_cross_entropy
from tests.helpers import assert_close


def _reference(h, w, labels, ignore_index=-100):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, labels, ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _ours(h, w, labels, **kwargs):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _inputs(N, D, V, *, ignored=0.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype) / D**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < ignored] = -100
    return h, w, labels


@pytest.mark.parametrize(
    "N, D, V, chunk",
    [
        (1, 3, 2, None),  # one token, two classes
        (13, 7, 11, 4),  # odd sizes, a ragged last chunk
        (16, 8, 33, 16),  # one chunk exactly
        (16, 8, 33, 5),  # chunk boundaries not aligned to anything
        (37, 16, 50, 1),  # one token per chunk
        (9, 5, 6, 100),  # chunk larger than N
    ],
)
@pytest.mark.parametrize("ignored", [0.0, 0.3])
def test_matches_reference_float64(N, D, V, chunk, ignored):
    h, w, labels = _inputs(N, D, V, ignored=ignored, seed=N * 1000 + V)
    if (labels != -100).sum() == 0:
        labels[0] = 0
    ref = _reference(h, w, labels)
    out = _ours(h, w, labels, chunk_size=chunk)
    for name, a, b in zip(("loss", "dh", "dW"), out, ref, strict=True):
        assert a.dtype == torch.float64
        assert_close(name, a, b, 1e-12)


def test_all_ignored_chunk_and_all_ignored_batch():
    h, w, labels = _inputs(12, 6, 9)
    labels[4:8] = -100  # one whole chunk of 4 ignored
    ref = _reference(h, w, labels)
    out = _ours(h, w, labels, chunk_size=4)
    for name, a, b in zip(("loss", "dh", "dW"), out, ref, strict=True):
        assert_close(name, a, b, 1e-12)
    assert out[1][4:8].abs().max() == 0  # an ignored token gets no gradient

    labels[:] = -100  # nothing counts: NaN loss and zero gradients, as F.cross_entropy
    loss, dh, dw = _ours(h, w, labels, chunk_size=5)
    ref_loss, ref_dh, ref_dw = _reference(h, w, labels)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(ref_dh, torch.zeros_like(ref_dh))
    assert torch.equal(dw, torch.zeros_like(dw))


def test_chunk_size_does_not_change_the_result():
    h, w, labels = _inputs(23, 8, 17, ignored=0.2, seed=3)
    results = [_ours(h, w, labels, chunk_size=c) for c in (1, 3, 23)]
    for other in results[1:]:
        for name, a, b in zip(("loss", "dh", "dW"), other, results[0], strict=True):
            assert_close(name, a, b, 1e-13)


def test_grad_output_scales_gradients():
    # A loss divided by gradient-accumulation steps, as a training loop does.
    h, w, labels = _inputs(10, 4, 7, seed=5)
    hr = h.clone().requires_grad_()
    (linear_cross_entropy(hr, w, labels) / 3).backward()
    _, dh, _ = _reference(h, w, labels)
    assert_close("dh / 3", hr.grad, dh / 3, 1e-12)


def test_autocast_bf16_float32_parameters():
    # Matmuls in bf16, softmax in float32: as accurate as autocast's F.linear + F.cross_entropy(logits.float()).
    h, w, labels = _inputs(40, 32, 64, ignored=0.1, dtype=torch.float32, seed=7)
    exact = _reference(h.double(), w.double(), labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _ours(h, w, labels, chunk_size=7)
        plain = _reference(h, w, labels)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32 and out[2].dtype == torch.float32
    for name, a, p, e in zip(("loss", "dh", "dW"), out, plain, exact, strict=True):
        err = (a.double() - e).norm() / e.norm()
        base = (p.double() - e).norm() / e.norm()
        assert err <= 2 * base + 1e-6, f"{name}: error {err:.2e} vs plain autocast {base:.2e}"


def test_input_errors():
    h, w, labels = _inputs(4, 3, 5)
    with pytest.raises(ValueError, match="labels must be integer"):
        linear_cross_entropy(h, w, labels[:3])
    with pytest.raises(ValueError, match="weight \\[V, D\\]"):
        linear_cross_entropy(h, w[:, :2], labels)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, labels, chunk_size=0)


def test_compile_fullgraph():
    h, w, labels = _inputs(11, 8, 13, ignored=0.2, dtype=torch.float32, seed=9)
    fn = torch.compile(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=4), fullgraph=True, backend="aot_eager")
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(hc, wc, labels)
    loss.backward()
    ref = _reference(h, w, labels)
    for name, a, b in zip(("loss", "dh", "dW"), (loss.detach(), hc.grad, wc.grad), ref, strict=True):
        assert_close(name, a, b, 1e-5)


def test_model_loss_without_logits_matches_the_plain_head():
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", residual="standard")).double()
    ids = torch.randint(0, 256, (2, 13))
    labels = ids.clone()
    labels[1, 5:9] = -100

    out = model(ids, labels=labels, return_logits=False)
    assert out.logits is None
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(ids).logits  # the plain head, then F.cross_entropy on the shifted logits
    ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    ref.backward()
    assert_close("loss", out.loss, ref, 1e-12)
    for name, p in model.named_parameters():
        assert_close(name, ours[name], p.grad, 1e-10)
