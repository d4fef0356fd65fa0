"""Chunked MLA prefill in the decompressed form (`mla_prefill`) against its float64 reference (`naive_mla_prefill`),
the attention-with-LSE kernels' math path, the exact LSE merge, and the contiguous and paged prefix readers. CPU."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.mla.lse_attention import attention_with_lse, pick_kernel
from hybrid_attention.ops.mla.naive_prefill import naive_mla_prefill
from hybrid_attention.ops.mla.prefill import (
    MIN_TILE_TOKENS,
    TILE_BYTES,
    decompressed_break_even,
    default_tile_size,
    merge_partial_,
    mla_prefill,
    up_projection_weights,
)
from hybrid_attention.ops.mla.prefix import contiguous_prefix, paged_prefix
from tests.helpers import DEV, assert_close, needs_triton

# Odd, distinct sizes so that a wrong view or split cannot line up by accident.
H, D_N, D_C, D_V = 3, 5, 10, 7


def make_problem(B, P, C, d_s=3, dtype=torch.float64, seed=0, spare=4):
    """Queries of a chunk, a cache of P + C rows followed by `spare` NaN rows, and the up-projections."""
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    cache = torch.cat([f(B, P + C, D_C + d_s), torch.full((B, spare, D_C + d_s), float("nan"))], dim=1)
    return dict(
        q=f(B, C, H, D_N + d_s).to(dtype),
        cache=cache.to(dtype),
        w_uk=(f(H, D_N, D_C) / D_C**0.5).to(dtype),
        w_uv=(f(H, D_V, D_C) / D_C**0.5).to(dtype),
        scale=(D_N + d_s) ** -0.5,
        P=P,
    )


def run(p, reader=None, **kw):
    P, C = p["P"], p["q"].shape[1]
    reader = reader or contiguous_prefix(p["cache"])
    rows = p["cache"][:, P : P + C]
    return mla_prefill(p["q"], rows, p["w_uk"], p["w_uv"], scale=p["scale"], prefix=reader, prefix_len=P, **kw)


def reference(p):
    P, C = p["P"], p["q"].shape[1]
    rows = p["cache"][:, : P + C].double()
    return naive_mla_prefill(p["q"].double(), rows[:, :P], rows[:, P:], p["w_uk"], p["w_uv"], scale=p["scale"])


@pytest.mark.parametrize(
    "P,C,tile",
    [(0, 1, None), (0, 9, None), (1, 1, None), (13, 7, None), (13, 7, 1), (13, 7, 5), (40, 16, 16), (40, 3, 7)],
)
@pytest.mark.parametrize("d_s", [3, 0])
def test_matches_reference(P, C, tile, d_s):
    """Causal within the chunk, full over the prefix (query i at position P + i), any tile size, rows past P + C NaN."""
    p = make_problem(2, P, C, d_s=d_s, seed=P * 100 + C)
    out = run(p, tile_size=tile)
    assert out.shape == (2, C, H, D_V) and out.dtype == torch.float64
    assert_close(f"P={P} C={C} tile={tile} d_s={d_s}", out, reference(p), 1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_precision(dtype, tol):
    p = make_problem(2, 29, 11, dtype=dtype, seed=3)
    out = run(p, tile_size=8)
    assert out.dtype == dtype
    assert_close(f"{dtype}", out, reference(p), tol)


def test_prefix_is_read_in_bounded_tiles_in_order():
    """The reader is asked for consecutive tiles of at most tile_size rows that cover the prefix once, never past it."""
    p = make_problem(1, 23, 5, seed=4)
    calls = []
    base = contiguous_prefix(p["cache"])

    def counting(start, stop):
        calls.append((start, stop))
        return base(start, stop)

    assert_close("counted", run(p, reader=counting, tile_size=6), reference(p), 1e-12)
    assert calls == [(0, 6), (6, 12), (12, 18), (18, 23)]


def test_paged_prefix_reads_what_the_contiguous_cache_holds():
    """Pages of 4 rows in a shuffled pool with a page table per sequence: every tile (page-aligned or not) is the
    same rows as the contiguous cache, and the prefill over it matches the reference."""
    B, P, C, page = 2, 26, 6, 4
    p = make_problem(B, P, C, seed=5)
    n_pages = -(-(P + C) // page)
    pool = torch.full((B * n_pages + 3, page, p["cache"].shape[2]), float("nan"), dtype=torch.float64)
    table = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(6))[: B * n_pages].view(B, n_pages)
    padded = torch.nn.functional.pad(p["cache"][:, : P + C], (0, 0, 0, n_pages * page - P - C), value=float("nan"))
    pool[table.flatten()] = padded.reshape(B * n_pages, page, -1)
    reader = paged_prefix(pool, table.int())
    for start, stop in [(0, 4), (0, 26), (3, 9), (8, 8), (25, 26), (5, 32)]:
        assert torch.equal(reader(start, stop), p["cache"][:, start:stop]), (start, stop)
    assert_close("paged", run(p, reader=reader, tile_size=7), reference(p), 1e-12)
    with pytest.raises(ValueError, match="pages"):
        reader(0, 4 * n_pages + 1)


def test_attention_with_lse_math_path():
    """o and lse against an explicit softmax, causal (square) and full (Tq != Tk), in query blocks too."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, *s, generator=g, dtype=torch.float64) for s in ((5, 8), (9, 8), (9, 6)))
    assert pick_kernel(q, k, v) == "math"
    o, lse = attention_with_lse(q, k, v, scale=0.4)
    scores = q @ k.transpose(-1, -2) * 0.4
    assert_close("lse", lse, torch.logsumexp(scores, -1), 1e-13)
    assert_close("o", o, torch.softmax(scores, -1) @ v, 1e-13)
    qs = q[:, :, :5]
    o, lse = attention_with_lse(qs, k[:, :, :5], v[:, :, :5], scale=0.4, causal=True)
    square = (qs @ k[:, :, :5].transpose(-1, -2) * 0.4).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    assert_close("causal lse", lse, torch.logsumexp(square, -1), 1e-13)
    assert_close("causal o", o, torch.softmax(square, -1) @ v[:, :, :5], 1e-13)


def test_math_path_in_query_blocks(monkeypatch):
    import hybrid_attention.ops.mla.lse_attention as lse_attention

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64) for _ in range(3))
    whole = attention_with_lse(q, k, v, scale=0.5, causal=True)
    monkeypatch.setattr(lse_attention, "MATH_SCORE_BUDGET", 2 * 11 * 3)  # blocks of 3 queries
    for a, b in zip(attention_with_lse(q, k, v, scale=0.5, causal=True), whole, strict=True):
        assert_close("blocked", a, b, 1e-14)


def test_merge_of_two_key_sets_equals_attention_over_both():
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 13, 8, generator=g), torch.randn(2, 3, 13, 5)
    q, k, v = q.double(), k.double(), v.double()
    o_a, lse_a = attention_with_lse(q, k[:, :, :6], v[:, :, :6], scale=0.3)
    o_b, lse_b = attention_with_lse(q, k[:, :, 6:], v[:, :, 6:], scale=0.3)
    acc = o_a.transpose(1, 2).clone()
    merge_partial_(acc, lse_a, o_b, lse_b)
    o, lse = attention_with_lse(q, k, v, scale=0.3)
    assert_close("merged o", acc, o.transpose(1, 2), 1e-13)
    assert_close("merged lse", lse_a, lse, 1e-13)


def test_up_projection_weights_build_per_head_keys_in_one_product():
    p = make_problem(1, 0, 6, seed=10)
    w_k, w_v = up_projection_weights(p["w_uk"], p["w_uv"], 3)
    rows = p["cache"][:, :6]
    k = (rows @ w_k.T).view(1, 6, H, D_N + 3)
    v = (rows[..., :D_C] @ w_v.T).view(1, 6, H, D_V)
    for h in range(H):
        assert_close(f"k_n head {h}", k[:, :, h, :D_N], rows[..., :D_C] @ p["w_uk"][h].T, 1e-14)
        assert torch.equal(k[:, :, h, D_N:], rows[..., D_C:])  # ones times k_s plus zeros: exact
        assert_close(f"v head {h}", v[:, :, h], rows[..., :D_C] @ p["w_uv"][h].T, 1e-14)


def test_break_even_and_tile_size():
    assert decompressed_break_even(8, 256, 32, 96, 128) == 242  # k3-scaled
    assert decompressed_break_even(2, 8, 0, 8, 8) > 1 << 40  # latent no wider than the heads: never
    for B in (1, 3, 32, 1000):
        tile = default_tile_size(B, 8, 256, 2)
        assert tile & (tile - 1) == 0 and tile >= MIN_TILE_TOKENS
        assert tile == MIN_TILE_TOKENS or B * tile * 8 * 256 * 2 <= TILE_BYTES


def test_bad_inputs():
    p = make_problem(1, 4, 3, seed=11)
    q, rows, w_uk, w_uv = p["q"], p["cache"][:, 4:7], p["w_uk"], p["w_uv"]
    with pytest.raises(ValueError, match="no prefix reader"):
        mla_prefill(q, rows, w_uk, w_uv, scale=0.3, prefix_len=4)
    with pytest.raises(ValueError, match="prefix_len"):
        mla_prefill(q, rows, w_uk, w_uv, scale=0.3, prefix_len=-1)
    with pytest.raises(ValueError, match="rows are"):
        mla_prefill(q, rows[..., :-1], w_uk, w_uv, scale=0.3)
    with pytest.raises(ValueError, match="do not agree"):
        mla_prefill(q, rows[:, :2], w_uk, w_uv, scale=0.3)
    with pytest.raises(ValueError, match="tile_size"):
        mla_prefill(q, rows, w_uk, w_uv, scale=0.3, prefix=contiguous_prefix(p["cache"]), prefix_len=4, tile_size=0)
    with pytest.raises(ValueError, match="reader gave"):
        mla_prefill(q, rows, w_uk, w_uv, scale=0.3, prefix=lambda a, b: rows[:, :1, :-1], prefix_len=4)
    k = torch.randn(1, 3, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="kernel must be"):
        attention_with_lse(k, k, k, scale=0.3, kernel="fast")
    with pytest.raises(ValueError, match="causal needs"):
        attention_with_lse(k[:, :, :2], k, k, scale=0.3, causal=True)
    with pytest.raises(ValueError, match="runs on CUDA"):
        attention_with_lse(k, k, k, scale=0.3, kernel="flash")
    with pytest.raises(ValueError, match="page_table"):
        paged_prefix(torch.zeros(4, 2, 3), torch.zeros(2, 2))


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize(
    "Tq,Tk,causal,D,DV", [(70, 70, True, 32, 32), (50, 131, False, 32, 16), (129, 129, True, 24, 40)]
)
def test_triton_kernel_matches_math_path(dtype, tol, Tq, Tk, causal, D, DV, poisoned):
    """The Triton kernel (the interpreter on CPU): tail blocks of queries and keys, padded head dims, causal."""
    g = torch.Generator().manual_seed(Tq + Tk)
    q, k, v = (torch.randn(2, 3, *s, generator=g).to(dtype).to(DEV) for s in ((Tq, D), (Tk, D), (Tk, DV)))
    o, lse = attention_with_lse(q, k, v, scale=D**-0.5, causal=causal, kernel="triton")
    ref_o, ref_lse = attention_with_lse(q.double(), k.double(), v.double(), scale=D**-0.5, causal=causal)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close("triton o", o, ref_o, tol)
    assert_close("triton lse", lse, ref_lse, 1e-6)


@needs_triton
def test_mla_prefill_through_the_triton_kernel():
    p = make_problem(2, 37, 20, dtype=torch.float32, seed=12)
    p = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    out = run(p, tile_size=16, kernel="triton")
    assert_close("triton prefill", out, reference(p), 1e-5)
