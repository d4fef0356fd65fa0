"""Triton KDA kernels on the CPU (Triton interpreter, set up by tests/conftest.py) or a GPU, at tiny shapes.

Against `recurrent_kda` in float64 on the same values: outputs, final states and every gradient (q, k, v, g or
z, beta, initial state, A_log, dt_bias), for lengths that cover one, two and partial chunks and sub-chunks,
varlen with an empty sequence, the fused gate and l2norm; plus bitwise prefix invariance (forward and
backward), NaN-poisoned buffers, the decode kernel, the custom ops under torch.compile and input errors.
The interpreter is slow: every case is one or two chunks, H <= 2, K, V <= 32, except one bfloat16 case, which
patches the interpreter to round float32 -> bfloat16 as the GPU does (it truncates);
tests/gpu/ops/kda/test_triton_gpu.py covers bfloat16 at real shapes.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.kda import chunk_kda, kda_gate, recurrent_kda
from hybrid_attention.ops.kda.gate import FORM_CODES
from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton
from hybrid_attention.ops.kda.triton_step import fused_recurrent_kda_step
from hybrid_attention.ops.kda.triton_utils import LOG2E, NARROW_BOUND, WIDE, narrow_span
from tests.helpers import DEV, assert_close, rel_err, round_bfloat16_like_the_gpu
from tests.ops.kda.cases import (
    CONFIG_CASES,
    changed_after,
    force_config,
    force_output_pass,
    make_inputs,
    poison_torch_empty,
    reference_kda,
    run,
    triton_kda,
)

if not torch.cuda.is_available():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it; without it the kernels cannot run on CPU
        pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

TOL32 = 1e-5  # float32 paths: a few float32 ulps of the outputs' scale


@pytest.fixture(params=["walk", "split"])
def output_pass(request, monkeypatch):
    """The forward's output computed inside the state walk, or in the separate per-chunk output pass."""
    force_output_pass(monkeypatch, request.param == "split")
    return request.param


def _grad_draw(inputs, cu_seqlens=None):
    """Output and final-state gradients from their own seeded generator: the same draw whatever ran before."""
    q, v = inputs[0], inputs[2]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    gen = torch.Generator().manual_seed(1000)
    do = torch.randn(v.shape, dtype=torch.float64, generator=gen).to(DEV)
    dS = torch.randn(N, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64, generator=gen).to(DEV)
    return do, dS


def compare(inputs, tol_o, tol_g, grad_tols=None, **kw):
    """Outputs and every gradient against the float64 reference; grad_tols overrides tol_g per gradient name."""
    q, v, h0 = inputs[0], inputs[2], inputs[5]
    do, dS = _grad_draw(inputs, kw.get("cu_seqlens"))
    o, S, grads = run(triton_kda, inputs, do, dS, **kw)
    ro, rS, rgrads = run(reference_kda, inputs, do, dS, **kw)
    assert o.dtype == v.dtype and S.dtype == torch.float32
    assert_close("o", o, ro, tol_o)
    assert_close("final state", S, rS, tol_o)
    assert set(grads) == set(rgrads) and (h0 is None) == ("h0" not in grads)
    for name, ref in rgrads.items():
        tol = (grad_tols or {}).get(name, tol_g)
        if name == "A_log":  # a sum over (t, c) with cancellation: its error is that of dz times the sum's condition
            terms = rgrads["g"].double() * (inputs[3].double() + inputs[7].double().view(q.shape[2], -1))
            tol = tol_g * float((terms.abs().sum((0, 1, 3)) / ref.double().abs().clamp_min(1e-30)).max())
        assert_close(f"d{name}", grads[name], ref, tol)
    return o, grads


@pytest.mark.parametrize(
    "B, T, H, K, V, h0",
    [(1, 1, 1, 16, 16, True), (1, 20, 2, 16, 32, False), (2, 70, 1, 32, 16, True)],
)
def test_matches_reference_float32(B, T, H, K, V, h0, output_pass):
    compare(make_inputs(B, T, H, K, V, h0=h0, seed=T), TOL32, TOL32)


def test_varlen_with_empty_sequence(output_pass):
    cu = torch.tensor([0, 5, 5, 70, 90], device=DEV)
    compare(make_inputs(1, 90, 1, 16, 16, N=4, seed=3), TOL32, TOL32, cu_seqlens=cu)


@pytest.mark.parametrize("K", [16, 80], ids=["K16-one-tile", "K80-two-tiles"])
def test_fused_gate_and_l2norm(K):
    # K <= 64 finishes the l2norm backward in the q/k/g kernel, K = 80 (two K tiles, masked) in its own kernel.
    compare(make_inputs(1, 40, 2 if K == 16 else 1, K, 16, gate=True, l2norm=True, seed=4), TOL32, TOL32, l2norm=True)


@pytest.mark.parametrize("k_tile", [16, 128])
def test_backward_k_tile(monkeypatch, k_tile):
    # DQKG_BK is the K tile of the dq/dk/dg kernel: 16 gives five tiles at K = 80, 128 one masked tile (and the
    # l2norm backward fused into that kernel); both must match the reference like the default.
    from hybrid_attention.ops.kda import chunk_bwd

    monkeypatch.setattr(chunk_bwd, "DQKG_BK", k_tile)
    compare(make_inputs(1, 40, 1, 80, 16, gate=True, l2norm=True, seed=7), TOL32, TOL32, l2norm=True)


@pytest.mark.parametrize("kernel, index", CONFIG_CASES, ids=[f"{n}-{i}" for n, i in CONFIG_CASES])
def test_every_autotune_config(kernel, index, monkeypatch):
    """Each non-first config alone (the other tests run only the first): its block sizes (a V tile wider than V
    here, so masks matter) must give the reference. Warps and stages do nothing under the interpreter; the GPU test
    of the same name covers them."""
    force_config(monkeypatch, kernel, index)
    compare(make_inputs(1, 70, 1, 32, 48, gate=True, l2norm=True, seed=20 + index), TOL32, TOL32, l2norm=True)


def test_gate_at_its_bound():
    """g = -5 everywhere: the exponents inside a sub-chunk span their full 115.4 (log2), the range the anchors and
    SHIFT are sized for. dg is held to 5e-5: a reverse cumulative sum with cancellation, it measures 2.0e-5 here in
    float32 (every other quantity within 1e-5)."""
    inputs = list(make_inputs(1, 70, 1, 16, 16, h0=True, seed=44))
    inputs[3] = torch.full_like(inputs[3], -5.0)
    compare(tuple(inputs), TOL32, TOL32, grad_tols={"g": 5e-5})


def _decay_case(kind, shape):
    gen = torch.Generator().manual_seed(45)
    if kind == "-8":
        return torch.full(shape, -8.0)
    if kind == "-1000":
        return torch.full(shape, -1000.0)
    # Mixed: ordinary decays, whole tokens and single channels at -1000 (erasing the state), some at -50.
    g = -5.0 * torch.rand(shape, generator=gen, dtype=torch.float64)
    g[:, torch.rand(shape[1], generator=gen) < 0.08] = -1000.0
    g[torch.rand(shape, generator=gen) < 0.05] = -50.0
    return g.float()


@pytest.mark.parametrize("kind", ["-8", "-1000", "mixed"])
def test_any_decay_is_exact(kind, output_pass):
    """Decays far below -5 per step: the anchored dots would overflow inside a sub-chunk, so those rows go pair by
    pair (forward and backward). Every quantity within float32 tolerance of the float64 recurrence, except dg, which
    is held to the same tolerance relative to the size of the terms it is the difference of (|q dq| + |k dk|): where
    the decay is strong, dg itself is orders of magnitude smaller than those terms (about 1e-3 of them at -8)."""
    inputs = list(make_inputs(1, 70, 1, 16, 16, seed=46))
    inputs[3] = _decay_case(kind, inputs[3].shape).to(DEV)
    _, grads = compare(inputs, TOL32, TOL32, grad_tols={"g": float("inf")})
    ref = run(reference_kda, inputs, *_grad_draw(inputs))[2]
    scale = (inputs[0].double() * ref["q"]).norm() + (inputs[1].double() * ref["k"]).norm()
    assert (grads["g"].double() - ref["g"]).norm() < TOL32 * (ref["g"].norm() + scale)


@pytest.mark.parametrize("l2norm", [False, True])
def test_softplus_gate_in_the_kernels(l2norm):
    """Kimi Linear's unbounded gate g = -exp(A_log) softplus(z + dt_bias), A_log = log of [1, 16]: decays down to
    about -100 per step, computed inside the kernels; outputs and every gradient, A_log and dt_bias included."""
    inputs = make_inputs(1, 70, 2, 16, 16, gate="softplus", l2norm=l2norm, seed=47)
    compare(inputs, TOL32, TOL32, grad_tols={"g": 5e-5}, l2norm=l2norm, form="softplus")


@pytest.mark.parametrize("pairs, split", [(1, True), (32, True), (33, False), (4096, False)])
def test_split_output_choice(pairs, split):
    from hybrid_attention.ops.kda.chunk_fwd import split_output

    assert split_output(pairs) is split


@pytest.mark.parametrize("used", ["state", "output"])
def test_gradient_through_one_output(used):
    # Autograd passes None (not a materialised zero) for the output that got no gradient.
    inputs = make_inputs(1, 70, 1, 16, 16, seed=6)
    grads = {}
    for name, fn in (("ours", triton_kda), ("ref", reference_kda)):
        leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
        o, S = fn(*leaves)
        (S.double().square().sum() if used == "state" else o.double().square().sum()).backward()
        grads[name] = [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves if x is not None]
    q_reaches_loss = used == "output"  # q enters the outputs only, never the state
    assert bool(grads["ref"][0].any()) == q_reaches_loss
    for mine, ref in zip(grads["ours"], grads["ref"], strict=True):
        if not ref.any():
            assert not mine.any()
            continue
        assert_close(f"gradient through the {used} alone", mine, ref, TOL32)


def test_float16(output_pass):
    # Half precision: the project's bf16 kernel tolerances (2e-2 on gradients) (float16 has 3 more mantissa bits).
    compare(make_inputs(1, 70, 1, 32, 32, dtype=torch.float16, seed=5), 1e-2, 2e-2)


def test_bfloat16_gate_gradient_as_accurate_as_the_others(monkeypatch):
    """bf16 at a real head size with GPU rounding: every quantity within 1e-2, half of the project's 2e-2 gradient
    tolerance, except d beta, which is held to that 2e-2. dg is the one that needs care: it is a reverse
    cumulative sum of terms that cancel in pairs, and before its score part was built from the dots' own rounded
    operands it measured 1.5e-2 here (and 2.2e-2 on the H200 at T = 4097) while every other quantity stayed below
    5e-3. d beta (one number per token and head, a sum over K and V) depends on the output-gradient draw through
    cancellation: over 30 draws of dO and dS on these inputs it measured 7e-4 to 1.45e-2 (dq, dk, dv, dg, dh0 always
    2.3e-3 to 4.7e-3)."""
    round_bfloat16_like_the_gpu(monkeypatch)
    inputs = make_inputs(1, 300, 2, 64, 64, dtype=torch.bfloat16, seed=6)
    compare(inputs, 1e-2, 1e-2, grad_tols={"beta": 2e-2})


def test_no_grad_forward_default_scale_and_dispatch(output_pass):
    q, k, v, g, beta, h0, _, _ = make_inputs(1, 20, 1, 16, 16, seed=6)
    with torch.no_grad():
        o, S = chunk_kda_triton(q, k, v, g, beta, initial_state=h0)
        o1, _ = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, scale=1.0)
        o2, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, backend="triton")  # the dispatcher routes here
    ro, _ = recurrent_kda(q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=h0.double())
    assert S is None
    assert_close("o", o, ro, TOL32)
    assert torch.equal(o2, o)
    assert rel_err(o1, o) > 0.1  # the scale is applied


def test_prefix_invariance_forward_and_backward():
    """Changing inputs after t changes no output at or before t, nor (with a loss on those outputs) any gradient
    at or before t, bit for bit. t sits inside a sub-chunk so later rows of its own sub-chunk change too."""
    t = 37
    base = make_inputs(1, 70, 1, 16, 16, gate=True, l2norm=True, seed=7)
    other = make_inputs(1, 70, 1, 16, 16, gate=True, l2norm=True, seed=8)
    do = torch.randn(1, 70, 1, 16, dtype=torch.float64, device=DEV)
    do[:, t + 1 :] = 0
    results = []
    for x in (base, changed_after(base, other, t)):
        o, _, grads = run(triton_kda, x, do, torch.zeros(1, 1, 16, 16, dtype=torch.float64, device=DEV), l2norm=True)
        results.append((o, grads))
    (o1, g1), (o2, g2) = results
    assert not torch.equal(o1, o2)  # the change is visible after t
    assert torch.equal(o1[:, : t + 1], o2[:, : t + 1])
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(g1[name][:, : t + 1], g2[name][:, : t + 1]), name
    for name in ("h0", "A_log", "dt_bias"):
        assert torch.equal(g1[name], g2[name]), name


def test_shared_anchor_prefix(monkeypatch):
    """The prep and dq/dk/dg kernels take the rows of a chunk's prefix whose span from the chunk's start fits in WIDE
    on one anchor, and the rows after it (f onwards) per sub-chunk. With a decay of -0.5, -0.5, -8 and -3 per step
    on the four 16-channel K tiles of the dq/dk/dg kernel, f is 64 (every row fits), 64, 10 (inside sub-chunk 0)
    and 26 (inside sub-chunk 1), in both chunks; the prep's 32-channel tiles have f = 64 and 10. Every output and
    gradient matches the float64 reference. Changing the inputs after t = 37, so that the rows a few steps after it
    stop fitting, leaves every output and gradient up to t bit-identical (a row's path depends on its prefix
    only)."""
    from hybrid_attention.ops.kda import chunk_bwd

    monkeypatch.setattr(chunk_bwd, "DQKG_BK", 16)
    base = list(make_inputs(1, 100, 1, 64, 16, seed=49))
    decay = torch.tensor([-0.5, -0.5, -8.0, -3.0], device=DEV).repeat_interleave(16)
    base[3] = decay.expand_as(base[3]).contiguous()
    compare(base, TOL32, TOL32, grad_tols={"g": 5e-5})  # dg: the cancelling reverse cumsum of the bound test

    t = 37
    changed = changed_after(base, list(make_inputs(1, 100, 1, 64, 16, seed=50)), t)
    changed[3][:, t + 1 :] = -9.0  # every tile stops fitting a few rows after t (the first two from f = 64)
    do, _ = _grad_draw(base)
    do[:, t + 1 :] = 0
    dS = torch.zeros(1, 1, 64, 16, dtype=torch.float64, device=DEV)
    (o1, _, g1), (o2, _, g2) = (run(triton_kda, x, do, dS) for x in (base, changed))
    assert torch.equal(o1[:, : t + 1], o2[:, : t + 1])
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(g1[name][:, : t + 1], g2[name][:, : t + 1]), name
    assert torch.equal(g1["h0"], g2["h0"])


POISONS = [("q", "nan"), ("k", "inf"), ("v", "nan"), ("g", "nan"), ("beta", "nan"), ("g", "0.5"), ("beta", "1.5")]


@pytest.mark.parametrize("name, value", POISONS)
def test_poisoned_future_leaves_the_past_bit_identical(name, value, output_pass):
    """A NaN or inf in one input at token t, inside a sub-chunk of the first chunk: the outputs before t are
    bit-identical to the clean run (the dots by lower triangular matrices take zeros for rows from the first
    non-finite one on); from t on they are not finite (only o_t for q), and neither is the final state. A decay
    g > 0 or a beta outside [0, 1] (which the kernels do not stop to raise for) counts as non-finite."""
    t = 45
    inputs = make_inputs(1, 70, 1, 16, 16, seed=48)
    with torch.no_grad():
        o, _ = triton_kda(*inputs)
        poisoned = list(inputs)
        poisoned[["q", "k", "v", "g", "beta"].index(name)] = inputs[["q", "k", "v", "g", "beta"].index(name)].clone()
        poisoned[["q", "k", "v", "g", "beta"].index(name)][:, t] = float(value)
        o2, S2 = triton_kda(*poisoned)
    assert torch.equal(o2[:, :t], o[:, :t])
    assert not torch.isfinite(o2[:, t]).any()
    if name == "q":
        assert torch.equal(o2[:, t + 1 :], o[:, t + 1 :])
    else:
        assert not torch.isfinite(o2[:, t:]).any() and not torch.isfinite(S2).any()


def test_poisoned_chunk_among_many_heads_and_flag_blocks(monkeypatch):
    """The prep kernel's checked path runs only for the (chunk, head) pairs the plain path flags, read a few flags
    per program: a NaN in k at one token of chunk 2 of head 2 (of 3 heads, 3 chunks; 4 flags per program, so pair 8
    is the only one of the third, partial block) leaves every other head and every earlier token bit-identical, and
    poisons that head from the token on."""
    import hybrid_attention.ops.kda.chunk_fwd as chunk_fwd

    monkeypatch.setattr(chunk_fwd, "REDO_FLAGS", 4)
    t, head = 130, 2
    inputs = make_inputs(1, 140, 3, 16, 16, gate=True, l2norm=True, seed=52)
    with torch.no_grad():
        o, S = triton_kda(*inputs, l2norm=True)
        poisoned = list(inputs)
        poisoned[1] = inputs[1].clone()
        poisoned[1][0, t, head, 3] = float("nan")
        o2, S2 = triton_kda(*poisoned, l2norm=True)
    others = [h for h in range(3) if h != head]
    assert torch.equal(o2[:, :, others], o[:, :, others]) and torch.equal(S2[:, others], S[:, others])
    assert torch.equal(o2[:, :t, head], o[:, :t, head])
    assert not torch.isfinite(o2[:, t:, head]).any() and not torch.isfinite(S2[:, head]).any()


@pytest.mark.parametrize("form", ["bounded", "softplus"])
def test_checked_prep_path_computes_the_same_bits(monkeypatch, form):
    """On usable inputs the prep kernel's checked path (which the plain path hands the chunks it cannot take) gives
    the same bits as the plain path: outputs, final state and every gradient, varlen, with the fused gate and
    l2norm; the softplus gate also sends rows down the pair-by-pair diagonal."""
    import functools

    import hybrid_attention.ops.kda.chunk_fwd as chunk_fwd

    inputs = make_inputs(1, 150, 1, 16, 16, N=2, gate=form, l2norm=True, seed=53)
    cu = torch.tensor([0, 61, 150], device=DEV)
    do, dS = _grad_draw(inputs, cu)
    plain = run(triton_kda, inputs, do, dS, l2norm=True, form=form, cu_seqlens=cu)
    monkeypatch.setattr(chunk_fwd, "prep_fwd", functools.partial(chunk_fwd.prep_fwd, checked_everywhere=True))
    checked = run(triton_kda, inputs, do, dS, l2norm=True, form=form, cu_seqlens=cu)
    assert torch.equal(plain[0], checked[0]) and torch.equal(plain[1], checked[1])
    for name, x in plain[2].items():
        assert torch.equal(x, checked[2][name]), f"d{name}"


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's float32 sums, as intended
def test_finite_values_whose_u_sum_overflows(output_pass):
    """The prep kernel checks a chunk for bad rows by the sum of U = T Diag(beta) v, which a non-finite row makes
    non-finite; finite values near float32's top can overflow that sum too. Such a chunk takes the masked pass
    with no row to mask, and its outputs and final state still match the float64 reference (forward only: the
    gradients of values this large overflow float32 themselves)."""
    q, k, v, g, beta, h0, A_log, dt_bias = make_inputs(1, 64, 1, 16, 16, seed=50)
    beta = torch.full_like(beta, 0.01)
    v = 5e37 * (1.0 + torch.rand(v.shape, generator=torch.Generator().manual_seed(51), dtype=torch.float64))
    v = v.float().to(DEV)  # every element finite, in [5e37, 1e38]
    assert torch.isinf((beta[..., None] * v).float().sum(dtype=torch.float32))  # U is within 20% of beta v here
    inputs = (q, k, v, g, beta, h0, A_log, dt_bias)
    with torch.no_grad():
        o, S = triton_kda(*inputs)
        ro, rS = reference_kda(*inputs)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close("o", o, ro, TOL32)
    assert_close("final state", S, rS, TOL32)


def test_backward_is_bitwise_repeatable():
    """Two backward passes on the same inputs give the same bits (no atomics; fixed reduction order), with the fused
    gate and l2norm and a softplus gate that sends some rows down the pair-by-pair path."""
    inputs = make_inputs(1, 70, 1, 16, 16, gate="softplus", l2norm=True, seed=49)
    do, dS = _grad_draw(inputs)
    first = run(triton_kda, inputs, do, dS, l2norm=True, form="softplus")[2]
    second = run(triton_kda, inputs, do, dS, l2norm=True, form="softplus")[2]
    for name, x in first.items():
        assert torch.equal(x, second[name]), name


def test_poisoned_buffers(monkeypatch, output_pass):
    """Every buffer the kernels allocate starts as NaN: an element they forget to write shows up."""
    poison_torch_empty(monkeypatch)
    cu = torch.tensor([0, 17, 70], device=DEV)
    _, grads = compare(make_inputs(1, 70, 1, 16, 16, N=2, gate=True, l2norm=True, seed=9), TOL32, TOL32,
                       cu_seqlens=cu, l2norm=True)  # fmt: skip
    assert all(torch.isfinite(x).all() for x in grads.values())


@pytest.mark.parametrize("lower_bound", [-5.0, -20.0])
def test_bounded_gate_either_side_of_the_narrow_bound(lower_bound):
    """At lower_bound -5 the bounded gate keeps every 16-token span within WIDE, and the kernels are compiled
    without the pair-by-pair path (`narrow_span`); at -20 gates near the bound make most spans wider, and the diagonal
    blocks go pair by pair. Both match the float64 reference, outputs and every gradient."""
    assert 16 * -NARROW_BOUND * LOG2E.value < WIDE.value  # a saturated gate at the bound still fits
    assert narrow_span(FORM_CODES["bounded"], lower_bound) == (lower_bound >= NARROW_BOUND)
    assert not narrow_span(FORM_CODES["softplus"], -1.0) and not narrow_span(0, -1.0)
    inputs = list(make_inputs(1, 70, 1, 16, 16, gate=True, seed=21))
    inputs[3] = inputs[3] + 8.0  # logits mostly past the sigmoid's knee: most steps near the bound
    z, A_log, dt_bias = inputs[3].double(), inputs[6].double(), inputs[7].double()
    g2 = kda_gate(z, A_log, dt_bias, lower_bound).cpu() * LOG2E.value  # [1, 70, 1, 16], log2 units
    subchunks = torch.nn.functional.pad(g2, (0, 0, 0, 0, 0, 80 - 70)).view(1, 5, 16, 1, 16)
    spans = -subchunks.cumsum(2).amin(-1)  # each row's span from its sub-chunk's anchor (any chunk: 64 = 4 x 16)
    assert bool((spans > WIDE.value).any()) == (lower_bound < NARROW_BOUND)
    compare(inputs, TOL32, TOL32, lower_bound=lower_bound)


def test_narrow_build_computes_the_same_bits(monkeypatch):
    """Where no row is wide, the build without the pair-by-pair path (NARROW) gives the same bits as the build with
    it: the path it leaves out is never taken there. Bounded gate at -5, outputs and every gradient."""
    import hybrid_attention.ops.kda.chunk_bwd as chunk_bwd
    import hybrid_attention.ops.kda.chunk_fwd as chunk_fwd

    inputs = make_inputs(1, 70, 2, 32, 16, gate=True, l2norm=True, seed=22)
    do, dS = _grad_draw(inputs)
    narrow = run(triton_kda, inputs, do, dS, l2norm=True)
    for module in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(module, "narrow_span", lambda gate, lower_bound: False)
    wide_capable = run(triton_kda, inputs, do, dS, l2norm=True)
    assert torch.equal(narrow[0], wide_capable[0]) and torch.equal(narrow[1], wide_capable[1])
    for name, x in narrow[2].items():
        assert torch.equal(x, wide_capable[2][name]), f"d{name}"


# V = 100: two 64-column state tiles, the second masked.
@pytest.mark.parametrize("gate, l2norm, T, V", [(False, False, 1, 16), (True, True, 3, 16), (True, True, 2, 100)])
def test_decode_step(gate, l2norm, T, V):
    q, k, v, g, beta, h0, A_log, dt_bias = make_inputs(3, T, 2, 32, V, gate=gate, l2norm=l2norm, seed=10)
    state = h0.clone()
    kw = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0) if gate else {}
    o = fused_recurrent_kda_step(q, k, v, g, beta, state, use_qk_l2norm=l2norm, **kw)
    ro, rS = reference_kda(q, k, v, g, beta, h0, A_log, dt_bias, l2norm=l2norm)
    assert_close("o", o, ro, TOL32)
    assert_close("state (in place)", state, rS, TOL32)


def test_prefill_then_decode_equals_one_pass():
    q, k, v, g, beta, h0, A_log, dt_bias = make_inputs(1, 22, 1, 16, 16, gate=True, l2norm=True, seed=11)
    gate = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    with torch.no_grad():
        full, _ = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True, **gate)
        pre, state = chunk_kda_triton(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], initial_state=h0,
                                      output_final_state=True, use_qk_l2norm=True, **gate)  # fmt: skip
        steps = [
            fused_recurrent_kda_step(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                g[:, t : t + 1],
                beta[:, t : t + 1],
                state,
                use_qk_l2norm=True,
                **gate,
            )  # fmt: skip
            for t in (20, 21)
        ]
    assert_close("prefill + decode", torch.cat([pre, *steps], 1), full, TOL32)


def test_compiles_without_graph_breaks():
    inputs = make_inputs(1, 20, 1, 16, 16, N=2, gate=True, l2norm=True, seed=12)
    cu = torch.tensor([0, 9, 20], device=DEV)
    do = torch.randn(1, 20, 1, 16, dtype=torch.float64, device=DEV)
    dS = torch.randn(2, 1, 16, 16, dtype=torch.float64, device=DEV)
    fn = lambda *x, **kw: triton_kda(*x, l2norm=True, cu_seqlens=cu, **kw)
    o, S, grads = run(fn, inputs, do, dS)
    co, cS, cgrads = run(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, do, dS)
    assert torch.equal(o, co) and torch.equal(S, cS)
    for name, x in grads.items():
        assert torch.equal(x, cgrads[name]), name


def test_decode_step_compiles_as_the_custom_op():
    """Traced, the step is the custom op (state mutated in the graph); the result equals the eager launch."""
    q, k, v, g, beta, h0, A_log, dt_bias = make_inputs(2, 2, 1, 16, 16, gate=True, l2norm=True, seed=15)
    kw = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm=True)
    eager_state, compiled_state = h0.clone(), h0.clone()
    o = fused_recurrent_kda_step(q, k, v, g, beta, eager_state, **kw)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(lambda *x: fused_recurrent_kda_step(*x, **kw), backend=backend, fullgraph=True)
    co = step(q, k, v, g, beta, compiled_state)
    assert torch.equal(o, co) and torch.equal(eager_state, compiled_state)
    assert any("kda_recurrent_step" in str(node.target) for gm in graphs for node in gm.graph.nodes)


def test_fake_implementations():
    """The fake (meta) implementations of the chunk forward and backward ops and of the decode step op (which
    mutates state)."""
    from hybrid_attention.ops.kda.triton_chunk import _bwd_op, _fwd_op
    from hybrid_attention.ops.kda.triton_step import _step_op

    q, k, v, g, beta, h0, A_log, dt_bias = make_inputs(1, 20, 1, 16, 16, gate=True, seed=13)
    args = (q, k, v, g, beta, h0, None, A_log, dt_bias.view(1, 16), 0.25, -5.0, True, True, True, True)
    torch.library.opcheck(_fwd_op, args, test_utils=("test_schema", "test_faketensor"))
    o, ht, *saved = _fwd_op(*args)
    for h0_needed in (True, False):
        args = (torch.randn_like(o), torch.randn_like(ht), q, k, v, g, beta, None, A_log, dt_bias.view(1, 16), saved,
                0.25, -5.0, True, True, h0_needed)  # fmt: skip
        torch.library.opcheck(_bwd_op, args, test_utils=("test_schema", "test_faketensor"))
    q, k, v, g, beta, h0, A_log, dt_bias = make_inputs(2, 1, 1, 16, 16, gate=True, seed=16)
    args = (q, k, v, g, beta, h0.clone(), A_log, dt_bias.view(1, 16), 0.25, -5.0, True, True, None)
    torch.library.opcheck(_step_op, args, test_utils=("test_schema", "test_faketensor"))
    pool = torch.randn(5, *h0.shape[1:], device=DEV)
    rows = torch.tensor([3, -1], device=DEV)
    args = (q, k, v, g, beta, pool, A_log, dt_bias.view(1, 16), 0.25, -5.0, True, True, rows)
    torch.library.opcheck(_step_op, args, test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs():
    q, k, v, g, beta, h0, _, _ = make_inputs(1, 20, 1, 16, 16, seed=14)
    for scale in (float("nan"), -1.0, 0.0):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            chunk_kda_triton(q, k, v, g, beta, scale=scale)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_triton(q, k, v, g, beta, chunk_size=32)
    with pytest.raises(ValueError, match="float64"):
        chunk_kda_triton(q.double(), k.double(), v.double(), g.double(), beta.double())
    big = torch.zeros(1, 4, 1, 257, device=DEV)
    with pytest.raises(ValueError, match="K and V"):
        chunk_kda_triton(big, big, v[:, :4], big, beta[:, :4])
    # 64 rows x 2^17 heads x 256 channels is 2^31: a chunk's tile offsets would leave int32 (views, no memory)
    wide = torch.zeros(1, 1, 1, 256, device=DEV).expand(1, 1, 2**17, 256)
    with pytest.raises(ValueError, match="at most 131071 heads at K = 256, V = 256, got 131072"):
        chunk_kda_triton(wide, wide, wide, -wide.abs(), torch.zeros(1, 1, 2**17, device=DEV))
    A_log, dt_bias = torch.zeros(1, device=DEV), torch.zeros(16, device=DEV)
    with pytest.raises(ValueError, match="need gate="):
        chunk_kda_triton(q, k, v, g, beta, A_log=A_log)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda_triton(q, k, v, g, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=0.0)
    with pytest.raises(ValueError, match="dt_bias"):
        chunk_kda_triton(q, k, v, g, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias[:8], lower_bound=-5.0)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda_triton(q, k, v, g, beta, initial_state=h0.double())
    with pytest.raises(ValueError, match="state"):
        fused_recurrent_kda_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], h0.double())
    with pytest.raises(ValueError, match="beta"):
        fused_recurrent_kda_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta, h0.clone())
    one = (q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    with pytest.raises(ValueError, match=r"state_indices must be an int64 \[B\] = \[1\]"):
        fused_recurrent_kda_step(*one, h0.clone(), state_indices=torch.tensor([0, 1], device=DEV))
    with pytest.raises(ValueError, match=r"state must be a contiguous float32 \[P, H, K, V\]"):
        fused_recurrent_kda_step(*one, h0[:, :, :8].clone(), state_indices=torch.tensor([0], device=DEV))
