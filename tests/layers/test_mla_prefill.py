"""Gated MLA with a cache: which form a multi-token chunk takes (decompressed `mla_prefill` or absorbed `mla_decode`),
and that both equal the explicit per-head reference over uneven chunks on a NaN-poisoned cache. CPU, float64."""

from __future__ import annotations

import pytest
import torch

import hybrid_attention.layers.mla as mla
from tests.helpers import assert_close
from tests.layers.test_mla import SIZES, decode_in_chunks, make_layer, reference_forward


def count_paths(monkeypatch) -> list[tuple[str, int]]:
    """Record ("prefill" | "decode", query tokens) for every attention call of the layer's two cached forms."""
    calls = []
    prefill, decode = mla.mla_prefill, mla.mla_decode

    def counting_prefill(q, *args, **kwargs):
        calls.append(("prefill", q.shape[1]))
        return prefill(q, *args, **kwargs)

    def counting_decode(q, *args, **kwargs):
        calls.append(("decode", q.shape[1]))
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(mla, "mla_prefill", counting_prefill)
    monkeypatch.setattr(mla, "mla_decode", counting_decode)
    return calls


@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_every_chunk_decompressed_equals_reference(q_lora_rank, monkeypatch):
    """Break-even lowered to 2 tokens: every multi-token chunk, after a prefix or not, takes the decompressed form."""
    monkeypatch.setattr(mla, "decompressed_break_even", lambda *sizes: 2)
    calls = count_paths(monkeypatch)
    layer = make_layer(q_lora_rank, seed=21)
    x = torch.randn(2, 27, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        out, cache = decode_in_chunks(layer, x, [5, 7, 1, 9, 3, 2])
    assert calls == [("prefill", 5), ("prefill", 7), ("decode", 1), ("prefill", 9), ("prefill", 3), ("prefill", 2)]
    assert_close("decompressed chunks vs reference", out, reference_forward(layer, x), 1e-12)


def test_form_follows_the_break_even():
    """At the layer's own sizes the break-even is 22 tokens: a first chunk is always decompressed, a later chunk from
    22 tokens on, a shorter one absorbed; the outputs match the reference either way."""
    sizes = (SIZES[k] for k in ("num_heads", "kv_lora_rank", "qk_shared_head_dim", "qk_nope_head_dim", "v_head_dim"))
    assert mla.decompressed_break_even(*sizes) == 22
    layer = make_layer(None, seed=22)
    x = torch.randn(1, 60, SIZES["hidden_size"], dtype=torch.float64)
    with pytest.MonkeyPatch.context() as m, torch.no_grad():
        calls = count_paths(m)
        out, _ = decode_in_chunks(layer, x, [3, 21, 22, 14])
    assert calls == [("prefill", 3), ("decode", 21), ("prefill", 22), ("decode", 14)]
    assert_close("mixed forms vs reference", out, reference_forward(layer, x), 1e-12)


def test_sequences_of_different_lengths_take_the_absorbed_form(monkeypatch):
    monkeypatch.setattr(mla, "decompressed_break_even", lambda *sizes: 2)
    layer = make_layer(None, seed=23)
    xs = torch.randn(2, 9, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        fulls = layer(xs)
        cache = layer.empty_cache(2, 9)
        cache.rows[0, :3] = decode_in_chunks(layer, xs[:1, :3], [3])[1].rows[0, :3]
        cache.rows[1, :5] = decode_in_chunks(layer, xs[1:, :5], [5])[1].rows[0, :5]
        cache.seqlens.set([3, 5])
        calls = count_paths(monkeypatch)
        cache.seqlens.advance(4)
        out = layer(torch.stack([xs[0, 3:7], xs[1, 5:9]]), cache=cache)
    assert calls == [("decode", 4)]
    assert_close("sequence 0", out[:1], fulls[:1, 3:7], 1e-10)
    assert_close("sequence 1", out[1:], fulls[1:, 5:9], 1e-10)
