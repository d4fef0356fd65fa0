"""The loss against position (`inference.position_loss`): buckets, per-token losses through the chunked cache against
the full forward's cross-entropy, the target each position is scored on, and bucket losses that average back to the
plain validation loss. CPU."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.position_loss import position_buckets, position_losses, token_losses
from hybrid_attention.model import HybridLM
from hybrid_attention.training.metrics import evaluate
from tests.helpers import assert_close


def tiny_model(dtype=torch.float64, **overrides) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", **overrides), kda_backend="torch").to(dtype).eval()
    with torch.no_grad():  # AttnRes away from its uniform start, so that every source counts
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_()
    return model


def test_buckets():
    assert position_buckets(2) == [(1, 2)]
    assert position_buckets(9) == [(1, 2), (2, 4), (4, 8), (8, 9)]
    assert position_buckets(2048)[-2:] == [(512, 1024), (1024, 2048)]
    assert position_buckets(100)[-1] == (64, 100)
    assert position_buckets(10, 3) == [(1, 4), (4, 7), (7, 10)]
    for seq_len, k in ((100, None), (100, 7), (37, 36), (2048, 1)):
        buckets = position_buckets(seq_len, k)
        covered = [p for start, stop in buckets for p in range(start, stop)]
        assert covered == list(range(1, seq_len)), (seq_len, k)  # every predicted position once, in order
    for seq_len, k in ((1, None), (10, 0), (10, 10)):
        with pytest.raises(ValueError, match="position_buckets"):
            position_buckets(seq_len, k)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("layer_types", [("kda", "kda", "kda", "mla"), ("mla", "mla")])
def test_token_losses_equal_the_full_forward(layer_types, chunk_size):
    """Through the cache in chunks (the last position of one predicting the first token of the next) the loss of
    each target equals the full forward's shifted cross-entropy."""
    model = tiny_model(layer_types=layer_types, mla_rope=layer_types == ("mla", "mla"))
    x = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        logits = model(x).logits
    ref = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")  # (B, T - 1)
    nll = token_losses(model, x, chunk_size=chunk_size)
    assert nll.shape == (2, 36) and nll.dtype == torch.float32
    assert_close(f"chunks of {chunk_size}", nll, ref, 1e-6)


def test_each_position_is_scored_on_its_own_target():
    """Changing the token at position p changes the loss recorded for p (the prediction of that token) and later
    ones, never the losses before it: position p is scored on x[p], predicted from x[:p]."""
    model = tiny_model()
    x = torch.randint(0, 256, (1, 40))
    p = 29  # past a chunk boundary, in the last power-of-two bucket
    changed = x.clone()
    changed[0, p] = (x[0, p] + 1) % 256
    nll, nll_changed = (token_losses(model, ids, chunk_size=8)[0] for ids in (x, changed))
    assert torch.equal(nll[: p - 1], nll_changed[: p - 1])
    assert nll[p - 1] != nll_changed[p - 1]
    with torch.no_grad():
        logp = model(x).logits[0, p - 1].double().log_softmax(-1)
    assert math.isclose(float(nll[p - 1]), -float(logp[x[0, p]]), rel_tol=1e-6)


@pytest.mark.parametrize("num_buckets", [None, 5])
def test_buckets_average_back_to_the_plain_loss(num_buckets):
    model = tiny_model(torch.float32)
    split = torch.randint(0, 256, (3000,))
    split[::7] = 32  # some structure, so the losses differ between positions
    byte_lengths = torch.ones(256, dtype=torch.long)
    byte_lengths[255] = 0  # the end-of-document token stands for no text
    kw = dict(batch_size=2, seq_len=45, num_batches=3)
    result = position_losses(model, split, byte_lengths, **kw, buckets=position_buckets(45, num_buckets), chunk_size=16)
    rows = result.rows(train_seq_len=16)
    assert sum(r["tokens"] for r in rows) == 6 * 44 and result.windows == 6
    loss, bpb = evaluate(model, split, byte_lengths, **kw, autocast=contextlib.nullcontext)
    weighted = sum(r["loss"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    assert math.isclose(weighted, loss, rel_tol=1e-5) and math.isclose(result.loss, loss, rel_tol=1e-5)
    assert math.isclose(result.bits_per_byte, bpb, rel_tol=1e-5)
    expected = ["yes" if r["start"] >= 16 else "partly" if r["stop"] > 16 else "no" for r in rows]
    assert [r["past_training"] for r in rows] == expected
    assert len({round(r["loss"], 6) for r in rows}) == len(rows)  # the buckets do differ
