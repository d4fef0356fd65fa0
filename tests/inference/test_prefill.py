"""Chunked prefill: any chunking, and a prompt continued on a non-empty cache, equals one full forward (MLA in either
form, KDA's recurrent state and conv tails carried exactly); the chunk size from the memory budget; the progress
bar. CPU, float64 on the tiny preset."""

from __future__ import annotations

import pytest
import torch

import hybrid_attention.layers.mla as mla
from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.prefill import (
    MAX_CHUNK,
    MIN_CHUNK,
    activation_bytes_per_token,
    chunk_size_for,
    prefill,
    prefill_chunk_size,
)
from hybrid_attention.layers.kda import KDACache
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close

T = 29


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HybridLM(HybridConfig.from_preset("tiny"), kda_backend="torch").double().eval()
    for name, p in m.named_parameters():  # non-trivial AttnRes mixing
        if name.endswith(".query"):
            p.data.normal_()
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def full(model, ids):
    """Last logits of one forward without a cache, and the caches of a one-call prefill."""
    cache = model.make_cache(2, T)
    prefill(model, ids, cache, chunk_size=T)
    with torch.no_grad():
        return model(ids).logits[:, -1], cache


def assert_caches_equal(got, ref, n):
    for i, (a, b) in enumerate(zip(got.layers, ref.layers, strict=True)):
        if isinstance(a, KDACache):
            for name in ("state", "conv_q", "conv_k", "conv_v"):
                assert_close(f"layer {i} {name}", getattr(a, name), getattr(b, name), 1e-12)
        else:
            assert_close(f"layer {i} rows", a.rows[:, :n], b.rows[:, :n], 1e-12)
    assert got.host_lengths == ref.host_lengths == [n] * 2


@pytest.mark.parametrize("chunk", [4, 7, 12])
@pytest.mark.parametrize("form", ["decompressed", "break-even"])
def test_chunked_prefill_equals_one_full_forward(model, ids, full, chunk, form, monkeypatch):
    """Chunk sizes that do not divide the prompt; "decompressed": every MLA chunk in the decompressed form."""
    if form == "decompressed":
        monkeypatch.setattr(mla, "decompressed_break_even", lambda *sizes: 2)
    logits, whole = full
    cache = model.make_cache(2, T + 3)
    assert_close("last logits", prefill(model, ids, cache, chunk_size=chunk), logits, 1e-10)
    assert_caches_equal(cache, whole, T)


@pytest.mark.parametrize("split,chunk", [(11, 5), (1, 8), (20, 3)])
def test_prompt_continued_on_a_non_empty_cache(model, ids, full, split, chunk, monkeypatch):
    """The first `split` tokens prefilled, then the rest in chunks of `chunk` on top: the same logits and states as
    one full pass (the MLA chunks after the first attend to a cached prefix in the decompressed form)."""
    monkeypatch.setattr(mla, "decompressed_break_even", lambda *sizes: 2)
    logits, whole = full
    cache = model.make_cache(2, T)
    prefill(model, ids[:, :split], cache, chunk_size=4)
    assert_close("continued", prefill(model, ids[:, split:], cache, chunk_size=chunk), logits, 1e-10)
    assert_caches_equal(cache, whole, T)


def test_chunk_size_from_the_budget():
    per_token = 100_000
    sizes = [chunk_size_for(budget, per_token, 1) for budget in (0, 1e7, 1e8, 1e9, 1e12)]
    assert sizes == sorted(sizes) and sizes[0] == MIN_CHUNK and sizes[-1] == MAX_CHUNK
    assert all(s & (s - 1) == 0 for s in sizes)  # powers of two: a chunked prefill repeats a few attention shapes
    assert chunk_size_for(1e9, per_token, 1) == 8192 and chunk_size_for(1e9, per_token, 4) == 2048
    k3 = HybridConfig.from_preset("k3-scaled")
    standard = HybridConfig.from_preset("k3-scaled", residual="standard")
    assert activation_bytes_per_token(k3, 2) > activation_bytes_per_token(standard, 2) > 0


def test_cpu_chunk_size_is_bounded(model):
    size = prefill_chunk_size(model, 3)
    assert MIN_CHUNK <= size <= MAX_CHUNK and size & (size - 1) == 0


def test_progress_bar(model, ids, capsys):
    prefill(model, ids[:, :9], model.make_cache(2, 9), chunk_size=4, progress=True)
    assert "prefill" in capsys.readouterr().err
    prefill(model, ids[:, :9], model.make_cache(2, 9), chunk_size=4)  # short: no bar before the delay
    prefill(model, ids[:, :9], model.make_cache(2, 9), chunk_size=4, progress=False)
    assert capsys.readouterr().err == ""


def test_bad_input(model, ids):
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(model, ids, model.make_cache(2, T), chunk_size=0)
    with pytest.raises(ValueError, match="no tokens"):
        prefill(model, ids[:, :0], model.make_cache(2, T))
