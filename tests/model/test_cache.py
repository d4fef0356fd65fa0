"""HybridCache and MLACache: exact byte accounting (k3-scaled hybrid against all-MLA), per-sequence lengths on the
device and the host, appends at per-sequence positions, reset, load_sequence and input checks."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.cache import HybridCache
from hybrid_attention.config import HybridConfig
from hybrid_attention.layers.kda import KDACache
from hybrid_attention.layers.mla import MLACache
from hybrid_attention.layers.seqlens import SeqLens
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close, poisoned_like


def meta_model(preset: str, dtype=torch.bfloat16) -> HybridLM:
    """The real preset on the meta device: shapes and byte counts without allocating a single weight."""
    with torch.device("meta"):
        return HybridLM(HybridConfig.from_preset(preset)).to(dtype)


def tiny(dtype=torch.float64, **overrides) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.from_preset("tiny", **overrides), kda_backend="torch").to(dtype).eval()


def test_k3_scaled_bytes_per_token_and_state_exactly():
    hybrid, all_mla = meta_model("k3-scaled"), meta_model("k3-scaled-all-mla")
    row = 256 + 32  # d_c + d_s
    assert hybrid.cache_bytes_per_token(torch.bfloat16) == 4 * row * 2 == 2304
    assert all_mla.cache_bytes_per_token(torch.bfloat16) == 13 * row * 2 == 7488
    # KDA: float32 state H x K x V plus three bf16 conv tails of width H*K and conv_size - 1 columns, 9 layers.
    per_kda = 8 * 128 * 128 * 4 + 3 * (8 * 128) * 3 * 2
    assert hybrid.state_bytes_per_sequence(torch.bfloat16) == 9 * per_kda == 4_884_480
    assert all_mla.state_bytes_per_sequence(torch.bfloat16) == 0


@pytest.mark.parametrize("context", [1, 4096, 131072])
def test_hybrid_cache_is_four_thirteenths_of_all_mla_plus_the_kda_state(context):
    hybrid, all_mla = meta_model("k3-scaled"), meta_model("k3-scaled-all-mla")
    B = 2
    h_cache, m_cache = hybrid.make_cache(B, context), all_mla.make_cache(B, context)
    state = hybrid.state_bytes_per_sequence(torch.bfloat16)
    assert h_cache.nbytes() == B * (context * hybrid.cache_bytes_per_token(torch.bfloat16) + state)
    assert m_cache.nbytes() == B * context * all_mla.cache_bytes_per_token(torch.bfloat16)
    assert 13 * (h_cache.nbytes() - B * state) == 4 * m_cache.nbytes()  # exactly 4/13 plus the constant state


def test_lengths_advance_on_device_and_host():
    model = tiny()
    cache = model.make_cache(2, 20)
    assert cache.lengths.dtype == torch.int32 and cache.lengths.tolist() == [0, 0] and cache.seq_len == 0
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 7)), cache=cache)
        model(torch.randint(0, 256, (2, 1)), cache=cache)
    assert cache.seq_len == 8 and cache.host_lengths == [8, 8] and cache.lengths.tolist() == [8, 8]
    mla = [layer for layer in cache.layers if isinstance(layer, MLACache)]
    assert mla and all(layer.seqlens is cache.seqlens for layer in mla), "one record, shared by every MLA layer"
    cache.advance(2, on_device=False)  # what DecodeStep does after a graph replay advanced the device lengths
    assert cache.host_lengths == [10, 10] and cache.lengths.tolist() == [8, 8]
    with pytest.raises(ValueError, match="capacity is 20 tokens, but 11 more after the 10"):
        cache.advance(11)
    assert cache.host_lengths == [10, 10] and cache.lengths.tolist() == [8, 8], "a rejected advance changes nothing"


def test_set_lengths_reset_and_errors():
    model = tiny()
    cache = model.make_cache(3, 10)
    with torch.no_grad():
        model(torch.randint(0, 256, (3, 4)), cache=cache)
    kda = [layer for layer in cache.layers if isinstance(layer, KDACache)]
    assert all(layer.state.abs().sum() > 0 for layer in kda)
    cache.set_lengths([4, 2, 0])
    assert cache.host_lengths == [4, 2, 0] and cache.seq_len == 4 and cache.lengths.tolist() == [4, 2, 0]
    cache.reset()
    assert cache.seq_len == 0 and cache.lengths.tolist() == [0, 0, 0]
    assert all(t.abs().sum() == 0 for layer in kda for t in (layer.state, layer.conv_q, layer.conv_k, layer.conv_v))
    with pytest.raises(ValueError, match="expected 3 lengths in \\[0, 10\\]"):
        cache.set_lengths([1, 2])
    with pytest.raises(ValueError, match="expected 3 lengths"):
        cache.set_lengths(11)


def test_load_sequence_places_a_prefilled_prompt_in_its_row():
    """A prompt prefilled alone and loaded into row 1 decodes exactly like the same prompt decoded alone."""
    model = tiny()
    prompt = torch.randint(0, 256, (1, 9))
    nxt = torch.randint(0, 256, (1, 1))
    with torch.no_grad():
        alone = model.make_cache(1, 12)
        model(prompt, cache=alone)
        ref = model(nxt, cache=alone).logits

        single = model.make_cache(1, 9)
        model(prompt, cache=single)
        batch = model.make_cache(3, 12)
        other = model.make_cache(1, 5)
        model(torch.randint(0, 256, (1, 5)), cache=other)
        batch.load_sequence(1, single)
        batch.load_sequence(2, other)
        assert batch.host_lengths == [0, 9, 5] and batch.lengths.tolist() == [0, 9, 5]
        # Row 0 is empty: it decodes its first token while rows 1 and 2 continue their prompts.
        out = model(torch.cat([nxt, nxt, nxt]), cache=batch).logits
    assert_close("loaded row vs alone", out[1:2], ref, 1e-12)
    assert batch.host_lengths == [1, 10, 6] and batch.lengths.tolist() == [1, 10, 6]
    with pytest.raises(ValueError, match="batch-1 cache"):
        batch.load_sequence(0, batch)
    with pytest.raises(ValueError, match="outside"):
        batch.load_sequence(3, single)
    big = model.make_cache(1, 20)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 13)), cache=big)
    with pytest.raises(ValueError, match="do not fit"):
        batch.load_sequence(0, big)


def test_mla_cache_appends_at_each_sequence_length():
    """The rows of a call go to the last positions the (already advanced) lengths count, per sequence."""
    rows = poisoned_like(torch.empty(3, 8, 5, dtype=torch.float64))
    cache = MLACache(rows=rows)
    cache.seqlens.set([0, 3, 1])
    cache.seqlens.advance(2)
    new = torch.randn(3, 2, 5, dtype=torch.float64)
    cache.append(new)
    assert cache.seqlens.lengths.tolist() == [2, 5, 3] and cache.seqlens.host == [2, 5, 3]
    for b, start in enumerate([0, 3, 1]):
        assert torch.equal(rows[b, start : start + 2], new[b])
        untouched = torch.cat([rows[b, :start], rows[b, start + 2 :]])
        assert torch.isnan(untouched).all(), f"sequence {b}: a row outside [{start}, {start + 2}) was written"
    with pytest.raises(ValueError, match="a sequence counts only 2; advance cache.seqlens"):
        cache.append(torch.randn(3, 3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"capacity is 8 tokens, but 4 more after the 5 already cached need 9"):
        cache.seqlens.advance(4)
    assert cache.seqlens.lengths.tolist() == [2, 5, 3], "a rejected advance must leave the lengths untouched"
    with pytest.raises(ValueError, match="seqlens must count B=3 sequences"):
        MLACache(rows=rows, seqlens=SeqLens(2, 8))
    with pytest.raises(ValueError, match="seqlens must count B=3 sequences of at most 8"):
        MLACache(rows=rows, seqlens=SeqLens(3, 9))
    with pytest.raises(ValueError, match="counts its tokens with another SeqLens"):
        HybridCache([cache], SeqLens(3, 8))
    with pytest.raises(ValueError, match="expected KDACache or MLACache"):
        HybridCache([rows], SeqLens(3, 8))


def test_nbytes_counts_data_not_bookkeeping():
    model = tiny(torch.float32)
    cache = model.make_cache(2, 7)
    expected = 2 * (7 * model.cache_bytes_per_token(torch.float32) + model.state_bytes_per_sequence(torch.float32))
    assert cache.nbytes() == expected
    assert "batch_size=2" in repr(cache) and "KKKM" in repr(cache)
