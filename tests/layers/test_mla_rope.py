"""Gated MLA with RoPE on the shared key part (`rope_theta`): prefill against the explicit per-head reference with the
rotation done as complex numbers, incremental decoding equal to the full forward, rotated cache rows, packed
documents, and that positions matter with RoPE and not without (causality: tests/layers/test_mla.py). CPU, float64."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.layers.mla import GatedMLA
from tests.helpers import assert_close
from tests.layers.test_mla import SIZES, assert_incremental_equals_full, feed, make_layer, reference_forward

ROPE = dict(qk_shared_head_dim=6, rope_theta=50.0)  # a small base: every channel pair turns visibly in a few tokens


@pytest.mark.parametrize("q_lora_rank", [None, 6])
@pytest.mark.parametrize("T", [1, 9, 31])
def test_prefill_matches_reference(q_lora_rank, T):
    layer = make_layer(q_lora_rank, seed=T, **ROPE)
    x = torch.randn(2, T, SIZES["hidden_size"], dtype=torch.float64)
    ref = reference_forward(layer, x)
    assert_close("RoPE prefill, no cache", layer(x), ref, 1e-12)
    assert_close("RoPE prefill, empty cache", feed(layer, x, layer.empty_cache(2, T + 2)), ref, 1e-12)


@pytest.mark.parametrize("chunks", [[6] + [1] * 9, [1] * 8, [4, 3, 1, 6, 2, 1], [12, 5]])
def test_incremental_decoding_equals_full_forward(chunks):
    # The cache holds k_s rotated at each token's position, as the reference builds it.
    assert_incremental_equals_full(make_layer(6, seed=len(chunks), **ROPE), chunks, "RoPE")


def test_prefill_gradients_match_reference():
    layer = make_layer(None, seed=3, **ROPE)
    x = torch.randn(2, 11, SIZES["hidden_size"], dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad((layer(x) * dy).sum(), params)
    ref_grads = torch.autograd.grad((reference_forward(layer, x) * dy).sum(), params)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        assert r.abs().max() > 0, f"{name}: reference gradient is zero, the test would prove nothing"
        assert_close(f"grad {name}", g, r, 1e-10)


@pytest.mark.parametrize("rope_theta", [None, 50.0])
def test_positions_matter_with_rope_only(rope_theta):
    """The last token sees every earlier one. Without RoPE it sees them as a set: shuffling them leaves its output
    unchanged (to rounding). With RoPE it sees where each one is: the shuffle changes the output."""
    layer = make_layer(None, seed=4, qk_shared_head_dim=6, rope_theta=rope_theta)
    T = 10
    x = torch.randn(2, T, SIZES["hidden_size"], dtype=torch.float64)
    shuffled = x.clone()
    shuffled[:, : T - 1] = x[:, torch.randperm(T - 1, generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        last, last_shuffled = layer(x)[:, -1], layer(shuffled)[:, -1]
    change = ((last - last_shuffled).norm() / last.norm()).item()
    if rope_theta is None:
        assert change < 1e-12, f"NoPE: the order of the context changed the output by {change:.2e}"
    else:
        assert change > 1e-3, f"RoPE: the order of the context changed the output by only {change:.2e}"


def test_packed_documents_each_start_at_position_zero():
    """Packed, each document is rotated from its own first token: logits equal each document run alone."""
    layer = make_layer(None, seed=5, **ROPE)
    lengths = [7, 1, 12]
    docs = [torch.randn(1, n, SIZES["hidden_size"], dtype=torch.float64) for n in lengths]
    cu_seqlens = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    with torch.no_grad():
        packed = layer(torch.cat(docs, dim=1), cu_seqlens=cu_seqlens)
        alone = torch.cat([layer(d) for d in docs], dim=1)
    assert_close("packed vs alone", packed, alone, 1e-12)


def test_bad_rope_settings():
    with pytest.raises(ValueError, match="even and >= 2"):
        GatedMLA(**{**SIZES, "qk_shared_head_dim": 3}, rope_theta=1e4)
    with pytest.raises(ValueError, match="even and >= 2"):
        GatedMLA(**{**SIZES, "qk_shared_head_dim": 0}, rope_theta=1e4)
    for theta in (0.5, True, "1e4", float("nan")):
        with pytest.raises(ValueError, match="rope_theta"):
            GatedMLA(**{**SIZES, "qk_shared_head_dim": 4}, rope_theta=theta)
