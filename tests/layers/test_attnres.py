"""Attention Residuals: the reference op's invariants, gradients, the AttnRes module at init, and the exact
two-phase (Block AttnRes) merge against the one-shot softmax. CPU, float64 unless a test says otherwise."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.layers.attnres import AttnRes
from hybrid_attention.ops.attnres.naive import (
    naive_attn_res,
    naive_attn_res_merge,
    naive_attn_res_partial,
    naive_attn_res_weights,
)
from tests.helpers import assert_close

B, T, D = 2, 5, 12


def make_sources(S, dtype=torch.float64, scale=1.0):
    # Different magnitude per source, as sublayer outputs have: the key norm must take care of it.
    return [torch.randn(B, T, D, dtype=dtype) * scale * (1 + 3 * i) for i in range(S)]


def params(dtype=torch.float64):
    return torch.randn(D, dtype=dtype), torch.rand(D, dtype=dtype) + 0.5


def explicit_attn_res(sources, query, key_weight, eps):
    """Loop over sources and tokens in float64: logit_i = w . (gamma * v_i / rms(v_i)), softmax, weighted sum."""
    V = torch.stack(sources).double()
    S = V.shape[0]
    h = torch.zeros(V.shape[1:], dtype=torch.float64)
    for b in range(V.shape[1]):
        for t in range(V.shape[2]):
            logits = torch.stack(
                [
                    (query.double() * key_weight.double() * V[i, b, t] / (V[i, b, t].pow(2).mean() + eps).sqrt()).sum()
                    for i in range(S)
                ]
            )
            p = torch.softmax(logits, dim=0)
            h[b, t] = (p[:, None] * V[:, b, t]).sum(0)
    return h


@pytest.mark.parametrize("S", [1, 4, 7])
def test_matches_explicit_reference(S):
    sources = make_sources(S)
    query, key_weight = params()
    ref = explicit_attn_res(sources, query, key_weight, 1e-6)
    assert_close("float64", naive_attn_res(sources, query, key_weight, 1e-6), ref, 1e-13)
    assert_close("stacked", naive_attn_res(torch.stack(sources), query, key_weight, 1e-6), ref, 1e-13)
    out32 = naive_attn_res([s.float() for s in sources], query.float(), key_weight.float(), 1e-6)
    assert out32.dtype == torch.float32
    assert_close("float32", out32, ref, 1e-5)
    out16 = naive_attn_res([s.bfloat16() for s in sources], query, key_weight, 1e-6)
    assert out16.dtype == torch.bfloat16
    ref16 = explicit_attn_res([s.bfloat16() for s in sources], query, key_weight, 1e-6)
    assert_close("bf16", out16, ref16, 1e-2)


def test_zero_query_gives_the_mean():
    sources = make_sources(6)
    zero, key_weight = torch.zeros(D, dtype=torch.float64), torch.rand(D, dtype=torch.float64) + 0.5
    p = naive_attn_res_weights(sources, zero, key_weight, 1e-6)
    assert torch.equal(p, torch.full_like(p, 1 / 6))
    assert_close("zero query", naive_attn_res(sources, zero, key_weight, 1e-6), torch.stack(sources).mean(0), 1e-15)


def test_probabilities_sum_to_one_and_ignore_source_scale():
    sources = make_sources(5)
    query, key_weight = params()
    query = query * 3  # sharp enough that the probabilities are far from uniform
    eps = 1e-30  # makes the key norm exactly scale-invariant, up to rounding
    p = naive_attn_res_weights(sources, query, key_weight, eps)
    assert p.shape == (5, B, T) and (p >= 0).all()
    assert_close("sum over sources", p.sum(0), torch.ones(B, T, dtype=torch.float64), 1e-15)
    assert (p.amax(0) - p.amin(0)).min() > 1e-3, "probabilities are nearly uniform, the test would prove nothing"
    scaled = list(sources)
    scaled[2] = scaled[2] * 37.5
    assert_close("scaled source", naive_attn_res_weights(scaled, query, key_weight, eps), p, 1e-13)
    perm = [3, 0, 4, 2, 1]
    assert_close("permuted", naive_attn_res_weights([sources[i] for i in perm], query, key_weight, eps), p[perm], 1e-14)
    h_perm = naive_attn_res([sources[i] for i in perm], query, key_weight, eps)
    assert_close("permuted h", h_perm, naive_attn_res(sources, query, key_weight, eps), 1e-14)


def test_output_is_a_convex_combination():
    sources = make_sources(5)
    query, key_weight = params()
    h = naive_attn_res(sources, 4 * query, key_weight, 1e-6)
    V = torch.stack(sources)
    assert (h >= V.amin(0) - 1e-12).all() and (h <= V.amax(0) + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_inputs_stay_finite(dtype):
    sources = make_sources(4, dtype=torch.float64, scale=1e4)
    query, key_weight = params()
    query = query * 50  # logits of order 1e2-1e3: softmax must subtract the max
    ref = explicit_attn_res(sources, query, key_weight, 1e-6)
    out = naive_attn_res([s.to(dtype) for s in sources], query.to(dtype), key_weight.to(dtype), 1e-6)
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ref_rounded = explicit_attn_res([s.to(dtype) for s in sources], query.to(dtype), key_weight.to(dtype), 1e-6)
    assert_close(f"1e4 inputs {dtype}", out, ref_rounded, tol)
    assert torch.isfinite(ref).all()


def test_gradcheck():
    sources = [s.requires_grad_(True) for s in make_sources(3)]
    query, key_weight = (t.requires_grad_(True) for t in params())
    assert torch.autograd.gradcheck(
        lambda *a: naive_attn_res(list(a[:3]), a[3], a[4], 1e-6), (*sources, query, key_weight)
    )


def test_module_at_init():
    torch.manual_seed(0)
    res = AttnRes(D).double()
    assert set(res.state_dict()) == {"query", "key_norm.weight"}
    assert torch.equal(res.query, torch.zeros(D, dtype=torch.float64))
    assert torch.equal(res.key_norm.weight, torch.ones(D, dtype=torch.float64))
    assert getattr(res.query, "_no_weight_decay", False) is True
    sources = [s.requires_grad_(True) for s in make_sources(4)]
    h = res(sources)
    assert_close("init is the mean", h, torch.stack(sources).mean(0), 1e-15)
    h.pow(2).sum().backward()
    assert res.query.grad.abs().max() > 1e-3, "the zero query must still receive a gradient"
    assert torch.equal(res.key_norm.weight.grad, torch.zeros(D, dtype=torch.float64))
    for s in sources:
        assert s.grad.abs().max() > 0


def test_module_matches_op():
    res = AttnRes(D, eps=1e-5).double()
    with torch.no_grad():
        res.query.normal_()
        res.key_norm.weight.uniform_(0.5, 1.5)
    sources = make_sources(4)
    ref = naive_attn_res(sources, res.query, res.key_norm.weight, 1e-5)
    assert_close("module forward", res(sources), ref, 1e-15)
    ref_p = naive_attn_res_weights(sources, res.query, res.key_norm.weight, 1e-5)
    assert_close("module weights", res.weights(sources), ref_p, 1e-15)
    out, lse = res.partial(sources[:3])
    assert_close("module two-phase", res.merge(out, lse, sources[3]), ref, 1e-14)


@pytest.mark.parametrize("num_blocks", [1, 2, 5])
def test_two_phase_merge_equals_one_softmax(num_blocks):
    blocks = make_sources(num_blocks + 1)
    blocks, partial = blocks[:num_blocks], blocks[num_blocks]
    query, key_weight = params()
    query = query * 3
    ref = naive_attn_res([*blocks, partial], query, key_weight, 1e-6)
    out, lse = naive_attn_res_partial(blocks, query, key_weight, 1e-6)
    assert out.shape == (B, T, D) and lse.shape == (B, T)
    assert_close(
        "phase 1 alone is attn_res over the blocks", out, naive_attn_res(blocks, query, key_weight, 1e-6), 1e-14
    )
    assert_close("merge", naive_attn_res_merge(out, lse, partial, query, key_weight, 1e-6), ref, 1e-14)

    # Phase 1 batched over the queries of a whole block, each merged with its own partial sum.
    queries, partials = torch.randn(3, D, dtype=torch.float64), make_sources(3)
    outs, lses = naive_attn_res_partial(torch.stack(blocks), queries, key_weight, 1e-6)
    assert outs.shape == (3, B, T, D) and lses.shape == (3, B, T)
    for q, o, l, p in zip(queries, outs, lses, partials, strict=True):
        merged = naive_attn_res_merge(o, l, p, q, key_weight, 1e-6)
        assert_close("batched phase 1", merged, naive_attn_res([*blocks, p], q, key_weight, 1e-6), 1e-14)


def test_two_phase_gradcheck():
    blocks = [s.requires_grad_(True) for s in make_sources(3)]
    query, key_weight = (t.requires_grad_(True) for t in params())

    def two_phase(b0, b1, partial, q, g):
        out, lse = naive_attn_res_partial([b0, b1], q, g, 1e-6)
        return naive_attn_res_merge(out, lse, partial, q, g, 1e-6)

    inputs = (*blocks, query, key_weight)
    assert torch.autograd.gradcheck(two_phase, inputs)
    grads = torch.autograd.grad(two_phase(*inputs).pow(2).sum(), inputs)
    ref_grads = torch.autograd.grad(naive_attn_res(blocks, query, key_weight, 1e-6).pow(2).sum(), inputs)
    for name, g, r in zip(["b0", "b1", "partial", "query", "key_weight"], grads, ref_grads, strict=True):
        assert_close(f"grad {name}", g, r, 1e-12)


def test_mixed_dtypes_promote_like_a_residual_sum():
    """Under autocast a float32 embedding meets bf16 sublayer outputs: they promote, as `h + f(h)` would."""
    query, key_weight = params()
    sources = [s.float() for s in make_sources(3)]
    mixed = [sources[0], sources[1].bfloat16(), sources[2].bfloat16()]
    out = naive_attn_res(mixed, query.float(), key_weight.float())
    assert out.dtype == torch.float32
    ref = naive_attn_res([s.float() for s in mixed], query.float(), key_weight.float())
    assert torch.equal(out, ref)


def test_bad_inputs():
    query, key_weight = params()
    sources = make_sources(2)
    with pytest.raises(ValueError, match="empty"):
        naive_attn_res([], query, key_weight)
    with pytest.raises(ValueError, match="same shape"):
        naive_attn_res([sources[0], sources[1][:, :3]], query, key_weight)
    with pytest.raises(ValueError, match=rf"query must have shape \[{D}\]"):
        naive_attn_res(sources, torch.zeros(D + 1, dtype=torch.float64), key_weight)
    with pytest.raises(ValueError, match="key_weight"):
        naive_attn_res(sources, query, key_weight[:-1])
    with pytest.raises(ValueError, match="query must have shape"):
        naive_attn_res_merge(sources[0], sources[0][..., 0], sources[1], torch.zeros(2, D, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="lse"):
        naive_attn_res_merge(sources[0], sources[0], sources[1], query, key_weight)
    with pytest.raises(ValueError, match=f"last dimension {D + 2}"):
        AttnRes(D + 2)(sources)
