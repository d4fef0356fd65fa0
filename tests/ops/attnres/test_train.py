"""Differentiable fused AttnRes (`ops.attnres.mix_norm_grad`, `ops.attnres.full_stream`, `ops.attnres.block_stream`):
the Triton kernels (interpreter on CPU, float64) against the readable references in `ops.attnres.naive` for the
outputs and every gradient, with NaN-poisoned output buffers, zero and non-zero pseudo-queries, bitwise repeatable
stream gradients, and the custom ops through `torch.library.opcheck`."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.attnres import triton_mix_norm, triton_stream_bwd
from hybrid_attention.ops.attnres.block_stream import attn_res_merge_norm_train, attn_res_partial_train
from hybrid_attention.ops.attnres.full_stream import attn_res_norm_step, attn_res_norm_stream_start, early_steps
from hybrid_attention.ops.attnres.mix_norm_grad import attn_res_norm_train
from hybrid_attention.ops.attnres.naive import naive_attn_res, naive_attn_res_merge, naive_attn_res_partial
from hybrid_attention.ops.attnres.rows import residual_scale
from hybrid_attention.ops.attnres.triton_stream_bwd import param_table_rows
from hybrid_attention.ops.numerics import rms_norm
from hybrid_attention.ops.triton_support import interpreting
from tests.helpers import DEV, assert_as_accurate, assert_close, round_bfloat16_like_the_gpu

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
F64 = torch.float64 if DEV == "cpu" else torch.float32  # float64 runs only under the interpreter
# float32 on CUDA against a float64 reference: the query gradient sums near-cancelling terms (dz_i sums to zero
# over the sources), so it carries a few float32 roundings more than the outputs.
TOL = 1e-12 if F64 == torch.float64 else 1e-4
SHAPE = (2, 3)  # B, T: tiny, the interpreter is slow
EPS, NORM_EPS = 1e-6, 1e-5


def sources(S, D, *, seed=0, dtype=F64, shape=SHAPE):
    """S leaf tensors [B, T, D] of very different scales, as sublayer outputs are."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(S, generator=g, dtype=torch.float64) * 4 + 0.1
    out = [torch.randn(*shape, D, generator=g, dtype=torch.float64) * scales[i] for i in range(S)]
    return [t.to(DEV, dtype).requires_grad_() for t in out]


def vectors(D, n, *, seed=0, zero_query=False, rows=None):
    """(query, key_weight, norm_weight, ...) leaves: a random (or zero) query, then weights around one."""
    g = torch.Generator().manual_seed(seed + 1000)
    shape = (D,) if rows is None else (rows, D)
    query = torch.zeros(shape, dtype=torch.float64) if zero_query else torch.randn(shape, generator=g).double()
    rest = [0.5 + torch.rand(shape, generator=g, dtype=torch.float64) for _ in range(n - 1)]
    return [t.to(DEV, F64).requires_grad_() for t in (query, *rest)]


def f64(tensors):
    """Float64 leaf copies: the references run in float64 whatever the kernels' precision."""
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def grads(out, inputs, seed=0):
    """Gradients of <out, cotangent> (a fixed random cotangent per output) with respect to `inputs`."""
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed + 7)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum() for o in outs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def check_grads(name, fused, ref, labels):
    for label, a, b in zip(labels, fused, ref, strict=True):
        if b is None:
            assert a is None or not a.any(), f"{name}: {label} has a gradient where the reference has none"
            continue
        assert a is not None, f"{name}: no gradient for {label}"
        assert_close(f"{name}: d {label}", a, b, TOL)


@pytest.mark.parametrize("S", [1, 2, 7, 27])
@pytest.mark.parametrize("zero_query", [False, True])
def test_full_matches_reference(S, zero_query, poisoned):
    D = 24 if S < 27 else 16
    src = sources(S, D, seed=S)
    query, key_w, norm_w = vectors(D, 3, seed=S, zero_query=zero_query)
    params = [query, key_w, norm_w]
    out = attn_res_norm_train(src, query, key_w, norm_w, EPS, NORM_EPS)
    src64, params64 = f64(src), f64(params)
    ref = rms_norm(naive_attn_res(src64, params64[0], params64[1], EPS), params64[2], NORM_EPS)
    assert out.dtype == src[0].dtype and out.shape == src[0].shape
    assert_close(f"full S={S}", out, ref, TOL)
    labels = [f"source {i}" for i in range(S)] + ["query", "key_weight", "norm_weight"]
    check_grads(f"full S={S}", grads(out, src + params), grads(ref, src64 + params64), labels)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_full_low_precision_sources(dtype, tol):
    """bf16 / float32 sources, float32 parameters: the float64 reference within the precision's rounding."""
    src64 = sources(5, 32, seed=11, dtype=torch.float64)
    src = [s.detach().to(dtype).requires_grad_() for s in src64]
    query, key_w, norm_w = (t.detach().float() for t in vectors(32, 3, seed=11))
    out = attn_res_norm_train(src, query, key_w, norm_w, EPS, NORM_EPS)
    ref = rms_norm(
        naive_attn_res([s.detach().double() for s in src], query.double(), key_w.double(), EPS),
        norm_w.double(),
        NORM_EPS,
    )
    assert out.dtype == dtype
    assert_close(f"full {dtype}", out, ref, tol)
    for s, g in zip(src, grads(out.double(), src), strict=True):
        assert g.dtype == dtype and torch.isfinite(g).all(), f"gradient of a {dtype} source: {g.dtype}, finite?"
        assert s.shape == g.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rounding_residual(dtype):
    """The forward's int8 rounding residual of h (half sources) gives the unrounded mixture back: h (1 + res / scale)
    within half a residual step, |h| eps / 254, of the float64 mixture, where h alone is off by up to |h| eps / 2;
    no residual is kept for float32 sources."""
    D, shape = 64, (4, 16)
    src = [s.detach().to(dtype) for s in sources(5, D, seed=13, dtype=torch.float64, shape=shape)]
    query, key_w, norm_w = (t.detach().float() for t in vectors(D, 3, seed=13))
    x, h, h_res, stats, logits = triton_mix_norm.full_fwd(
        src, query, key_w, norm_w, EPS, NORM_EPS, save_h=True, save_logits=True
    )
    scale = residual_scale(dtype)
    if not scale:
        assert h_res.dtype == torch.int8 and h_res.numel() == 0
        return
    assert h_res.dtype == torch.int8 and h_res.shape == h.shape
    v64 = [s.double() for s in src]
    mixture = naive_attn_res(v64, query.double(), key_w.double(), EPS)
    h64 = h.double()
    step_err = h64.abs() * torch.finfo(dtype).eps / 254
    float32_err = 1e-6 * torch.stack(v64).abs().amax(0)  # the kernel's float32 sums
    rebuilt = h64 * (1 + h_res.double() / scale)
    assert ((rebuilt - mixture).abs() <= step_err + float32_err).all(), (rebuilt - mixture).abs().max()
    assert (h64 - mixture).abs().max() > 20 * (rebuilt - mixture).abs().max(), "the residual adds no precision"


def run_chain(src, params, start, used):
    """Steps l = start .. S of a Full AttnRes stream over the leaves `src` (step l reads src[:l]), step l with its
    own (query, key_weight, norm_weight) params[l - start]; -> the outputs of the steps in `used` (step numbers)."""
    queries, key_weights, norm_weights = (torch.stack([p[i] for p in params]) for i in range(3))
    outs, carrier = [], None
    for l in range(start, len(src) + 1):
        if carrier is None:
            x, carrier = attn_res_norm_stream_start(src[:l], queries, key_weights, norm_weights, EPS, NORM_EPS)
        else:
            x, carrier = attn_res_norm_step(src[:l], carrier, NORM_EPS)
        outs += [x] if l in used else []
    return tuple(outs)


def reference_chain(src, params, start, used):
    return tuple(
        rms_norm(naive_attn_res(src[:l], q, kw, EPS), nw, NORM_EPS)
        for (q, kw, nw), l in zip(params, range(start, len(src) + 1), strict=True)
        if l in used
    )


@pytest.mark.parametrize(
    "S, start, used",
    [
        (2, 1, "all"),
        (7, 1, "all"),
        (7, 3, "all"),  # the stream starts with three sources
        (9, 2, (2, 3, 5, 6)),  # some outputs unused, the last ones too: steps pass the tables on or start them
        (27, 2, "all"),  # the k3-scaled depth (on one row: the interpreter runs every program in Python)
    ],
)
def test_chain_matches_reference(S, start, used, poisoned):
    """A Full AttnRes stream (`attn_res_norm_stream_start`, `attn_res_norm_step`), whose backwards assemble each
    source's gradient once, against the reference step by step: every output and the gradient of every source and
    every step's parameters."""
    D = 16
    used = range(start, S + 1) if used == "all" else used
    src = sources(S, D, seed=S + start, shape=(1, 1) if S > 9 else SHAPE)
    params = [vectors(D, 3, seed=100 * S + l, zero_query=l == start + 1) for l in range(start, S + 1)]
    outs = run_chain(src, params, start, used)
    src64, params64 = f64(src), [f64(p) for p in params]
    refs = reference_chain(src64, params64, start, used)
    for l, out, ref in zip(used, outs, refs, strict=True):
        assert_close(f"chain S={S} step {l}", out, ref, TOL)
    flat, flat64 = [p for ps in params for p in ps], [p for ps in params64 for p in ps]
    labels = [f"source {i}" for i in range(S)] + [f"step {l} {n}" for l in range(start, S + 1) for n in "wgn"]
    fused_grads, ref_grads = grads(outs, src + flat), grads(refs, src64 + flat64)
    # Every step's parameters reach their gradients through one stack per kind: an unused step's are zero, not None
    # (check_grads asserts that).
    stacked = {len(src) + 3 * k + j for k in range(len(params)) for j in (0, 1, 2)}
    unused = [i for i, g in enumerate(fused_grads) if g is None and i not in stacked]
    ref_unused = [i for i, g in enumerate(ref_grads) if g is None and i not in stacked]
    assert unused == ref_unused, "unused inputs differ from the reference's"
    check_grads(f"chain S={S}", fused_grads, ref_grads, labels)


def test_chain_gradients_repeat_bitwise():
    """Two backwards of the same stream give bitwise equal gradients (fixed summation orders, no atomics)."""
    S, D = 7, 16
    src = sources(S, D, seed=61)
    params = [vectors(D, 3, seed=61 + l) for l in range(2, S + 1)]
    inputs = src + [p for ps in params for p in ps]
    first, second = (grads(run_chain(src, params, 2, range(2, S + 1)), inputs) for _ in range(2))
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(a, b), f"gradient of input {i} differs between two runs"


def tile_values(tuners, block):
    return sorted({c.kwargs[block] for t in tuners for c in t.all_configs})


def only_config(monkeypatch, tuner, block, value):
    """Let `tuner` run the config with `block` == value alone (the nearest one when it has none)."""
    config = next((c for c in tuner.all_configs if c.kwargs[block] == value), None)
    if config is None:
        config = min(tuner.all_configs, key=lambda c: abs(c.kwargs[block] - value))
    monkeypatch.setattr(tuner, "configs", [config])


SOURCE_TILED = (triton_mix_norm._full_fwd_kernel, triton_mix_norm._full_bwd_kernel)


@pytest.mark.parametrize("block_s", tile_values(SOURCE_TILED, "BLOCK_S"))
def test_every_tile_height(block_s, monkeypatch):
    """The forward and backward kernels with each source-tile height of their tuned configs (sources split across
    tiles, a partial last tile), alone: one AttnRes, and a short stream, against the reference."""
    for tuner in SOURCE_TILED:
        only_config(monkeypatch, tuner, "BLOCK_S", block_s)
    S, D = 7, 16
    src = sources(S, D, seed=52)
    query, key_w, norm_w = vectors(D, 3, seed=52)
    out = attn_res_norm_train(src, query, key_w, norm_w, EPS, NORM_EPS)
    src64, (q64, k64, n64) = f64(src), f64([query, key_w, norm_w])
    ref = rms_norm(naive_attn_res(src64, q64, k64, EPS), n64, NORM_EPS)
    assert_close(f"BLOCK_S={block_s} one AttnRes", out, ref, TOL)
    labels = [f"source {i}" for i in range(S)] + ["query", "key_weight", "norm_weight"]
    inputs = [*src, query, key_w, norm_w]
    check_grads(f"BLOCK_S={block_s}", grads(out, inputs), grads(ref, [*src64, q64, k64, n64]), labels)
    check_stream(f"BLOCK_S={block_s}")


ROW_BLOCKED = (triton_stream_bwd._stream_local_kernel, triton_stream_bwd._stream_bwd_kernel)


@pytest.mark.parametrize("block_m", tile_values(ROW_BLOCKED, "BLOCK_M"))
def test_every_row_block(block_m, monkeypatch):
    """The stream's two backward kernels with each row-block height of their tuned configs (a partial last block,
    programs with no rows), alone, on a short stream against the reference."""
    for tuner in ROW_BLOCKED:
        only_config(monkeypatch, tuner, "BLOCK_M", block_m)
    check_stream(f"BLOCK_M={block_m}")


def check_stream(name):
    """Steps 2 .. 7 of a stream over 7 sources against the reference: outputs and every gradient."""
    S, D = 7, 16
    src = sources(S, D, seed=51)
    params = [vectors(D, 3, seed=51 + l) for l in range(2, S + 1)]
    outs = run_chain(src, params, 2, range(2, S + 1))
    src64, params64 = f64(src), [f64(p) for p in params]
    refs = reference_chain(src64, params64, 2, range(2, S + 1))
    for l, out, ref in zip(range(2, S + 1), outs, refs, strict=True):
        assert_close(f"{name} step {l}", out, ref, TOL)
    flat, flat64 = [p for ps in params for p in ps], [p for ps in params64 for p in ps]
    labels = [f"source {i}" for i in range(S)] + [f"step {l} {n}" for l in range(2, S + 1) for n in "wgn"]
    check_grads(name, grads(outs, src + flat), grads(refs, src64 + flat64), labels)


@pytest.mark.parametrize(
    "dtype, gpu_rounding, zero_query",
    [
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, False),
        (torch.bfloat16, True, True),  # the pseudo-queries' initialisation: uniform weights
        (torch.float16, False, False),
    ],
    ids=["bf16-truncated", "bf16-rounded", "bf16-rounded-zero-query", "fp16"],
)
def test_chain_low_precision(dtype, gpu_rounding, zero_query, monkeypatch):
    """Half sources, float32 parameters (dh stored in the sources' dtype, dz r as two half parts for the dL/du
    product): every output and gradient as accurate against float64 as the plain composition at the same precision.
    The sources share a direction (cosines around 0.5), so dz_i = p_i (dh . v_i - dh . h) cancels: c = dh . h must
    come from the unrounded mixture (its rounding residual), or the parameters' gradients are several times less
    accurate. bf16 both as the interpreter converts (truncating) and as the GPU does (to nearest even)."""
    if gpu_rounding:
        round_bfloat16_like_the_gpu(monkeypatch)
    S, D, shape = 6, 64, (2, 16)
    independent = sources(S, D, seed=41, dtype=torch.float64, shape=shape)
    src64 = [independent[0].detach() + s.detach() for s in independent]
    params32 = [[t.detach().float() for t in vectors(D, 3, seed=41 + l, zero_query=zero_query)] for l in range(S)]
    cots = [
        torch.randn(*shape, D, generator=torch.Generator().manual_seed(42 + l), dtype=torch.float64) for l in range(S)
    ]
    results = {}
    for name, sdt in (("fused", dtype), ("plain", dtype), ("ref", torch.float64)):
        src = [s.to(dtype).to(sdt).requires_grad_() for s in src64]
        pdt = torch.float32 if sdt == dtype else sdt
        params = [[t.to(pdt).requires_grad_() for t in p] for p in params32]
        chain = run_chain if name == "fused" else reference_chain
        outs = chain(src, params, 1, range(1, S + 1))
        loss = sum((o.double() * c).sum() for o, c in zip(outs, cots, strict=True))
        results[name] = (outs, torch.autograd.grad(loss, src + [p for ps in params[1:] for p in ps]))
    (fo, fg), (po, pg), (ro, rg) = results["fused"], results["plain"], results["ref"]
    for l, (f, p, r) in enumerate(zip(fo, po, ro, strict=True)):
        assert f.dtype == dtype
        assert_as_accurate(f"chain {dtype} step {l + 1}", f, r, p, floor=2**-8)
    # Step 1 reads one source: its query and key weight get no gradient, so they are left out.
    labels = [f"source {i}" for i in range(S)] + [f"step {l} {n}" for l in range(2, S + 1) for n in "wgn"]
    for label, f, p, r in zip(labels, fg, pg, rg, strict=True):
        assert f.dtype == p.dtype, label
        assert_as_accurate(f"chain {dtype} d {label}", f, r, p, floor=2**-12)


@pytest.mark.parametrize(
    "dtype, n, M, steps",
    [
        (torch.bfloat16, 1, 37, 3),  # one source passed itself, two splits of the rows, the last one partial
        (torch.float16, 3, 70, 35),  # a pointer table, more steps than one block of them
        (torch.float32, 2, 5, 2),
        (torch.float64, 1, 33, 4),
    ],
)
def test_dzr_products(dtype, n, M, steps):
    """The dL/du product (`add_dzr_products_`) adds sum_j sum_planes dzr[j, plane] @ v_j to rows step.. of the
    stream's partial sums, against a float64 product; the other rows and the earlier values are kept."""
    D, K = 24, steps + 2
    g = torch.Generator().manual_seed(M + n)
    srcs = [torch.randn(M, D, generator=g, dtype=torch.float64).to(DEV, dtype) for _ in range(n)]
    half = dtype in (torch.bfloat16, torch.float16)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    dzr = torch.randn(n, 2 if half else 1, K - 2, M, generator=g, dtype=torch.float64).to(DEV, dtype if half else cdt)
    splits, _ = param_table_rows(M, srcs[0].device)
    assert splits == -(-M // triton_stream_bwd.DU_ROWS)  # M < DU_ROWS * DU_SPLITS here: each split's rows, some partial
    part = torch.randn(splits, K, D, generator=g, dtype=torch.float64).to(DEV, cdt)
    before = part.clone()
    triton_stream_bwd.add_dzr_products_(srcs, dzr, part, 2)
    want = before.double().sum(0)
    for j, v in enumerate(srcs):
        want[2:] += dzr[j].double().sum(0) @ v.double()
    assert torch.equal(part[:, :2], before[:, :2]), "rows of earlier steps changed"
    assert_close(f"dzr products {dtype}", part.double().sum(0), want, 1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("N, Q", [(1, 1), (3, 2), (5, 3)])
@pytest.mark.parametrize("zero_query", [False, True])
def test_partial_matches_reference(N, Q, zero_query, poisoned):
    D = 24
    blocks = sources(N, D, seed=N)
    queries, key_ws = vectors(D, 2, seed=N + Q, zero_query=zero_query, rows=Q)
    out, lse = attn_res_partial_train(blocks, queries, key_ws, EPS)
    blocks64, (queries64, key_ws64) = f64(blocks), f64([queries, key_ws])
    ref = [naive_attn_res_partial(blocks64, queries64[q], key_ws64[q], EPS) for q in range(Q)]
    ref_out, ref_lse = [r[0] for r in ref], torch.stack([r[1] for r in ref])
    assert len(out) == Q and all(o.shape == (*SHAPE, D) for o in out) and lse.shape == (Q, *SHAPE)
    assert_close(f"partial N={N} Q={Q} out", torch.stack(out), torch.stack(ref_out), TOL)
    assert_close(f"partial N={N} Q={Q} lse", lse, ref_lse, TOL)
    labels = [f"block {i}" for i in range(N)] + ["queries", "key_weights"]
    fused_grads = grads((*out, lse), [*blocks, queries, key_ws])
    check_grads(
        f"partial N={N} Q={Q}", fused_grads, grads((*ref_out, ref_lse), [*blocks64, queries64, key_ws64]), labels
    )


def test_partial_with_unused_outputs():
    """Only some of phase 1's outputs reach the loss (the others get zero gradients): every gradient still equals
    the reference's."""
    D, Q = 20, 4
    blocks = sources(3, D, seed=17)
    queries, key_ws = vectors(D, 2, seed=18, rows=Q)
    out, lse = attn_res_partial_train(blocks, queries, key_ws, EPS)
    blocks64, (queries64, key_ws64) = f64(blocks), f64([queries, key_ws])
    ref = [naive_attn_res_partial(blocks64, queries64[q], key_ws64[q], EPS) for q in range(Q)]
    labels = [f"block {i}" for i in range(3)] + ["queries", "key_weights"]
    fused = grads((out[2], lse[0]), [*blocks, queries, key_ws])
    check_grads("partial, outputs 2 and lse 0", fused, grads((ref[2][0], ref[0][1]), [*blocks64, queries64, key_ws64]),
                labels)  # fmt: skip


@pytest.mark.parametrize("with_partial", [True, False])
@pytest.mark.parametrize("zero_query", [False, True])
def test_merge_norm_matches_reference(with_partial, zero_query, poisoned):
    """Phase 2 + RMSNorm on a real phase-1 result (so lse is consistent with out), every gradient."""
    D = 24
    blocks = sources(4, D, seed=3)
    (partial,) = sources(1, D, seed=4)
    query, key_w, norm_w = vectors(D, 3, seed=5, zero_query=zero_query)
    with torch.no_grad():
        out0, lse0 = naive_attn_res_partial(blocks, query, key_w, EPS)
    out, lse = out0.clone().requires_grad_(), lse0.clone().requires_grad_()
    P = partial if with_partial else None
    x = attn_res_merge_norm_train(out, lse, P, query, key_w, norm_w, EPS, NORM_EPS, dtype=F64)
    inputs = [out, lse, partial, query, key_w, norm_w]
    o64, l64, p64, q64, k64, n64 = inputs64 = f64(inputs)
    h = naive_attn_res_merge(o64, l64, p64, q64, k64, EPS) if with_partial else o64
    ref = rms_norm(h, n64, NORM_EPS)
    assert_close(f"merge partial={with_partial}", x, ref, TOL)
    check_grads(
        f"merge partial={with_partial}", grads(x, inputs), grads(ref, inputs64),
        ["out", "lse", "partial", "query", "key_weight", "norm_weight"],
    )  # fmt: skip


def test_two_phases_equal_full_attnres():
    """Phase 1 over completed blocks merged with the partial sum equals one softmax over all of them."""
    D = 16
    blocks = sources(4, D, seed=21)
    query, key_w, norm_w = vectors(D, 3, seed=21)
    out, lse = attn_res_partial_train(blocks[:3], query[None], key_w[None], EPS)
    x = attn_res_merge_norm_train(out[0], lse[0], blocks[3], query, key_w, norm_w, EPS, NORM_EPS)
    full = attn_res_norm_train(blocks, query, key_w, norm_w, EPS, NORM_EPS)
    assert_close("two phases vs one", x, full, TOL)  # both fused: the same precision
    inputs = [*blocks, query, key_w, norm_w]
    check_grads("two phases vs one", grads(x, inputs), grads(full, inputs), ["b0", "b1", "b2", "b3", "w", "g", "nw"])


def test_block_low_precision():
    """bf16 blocks and partial sum, float32 parameters: phase 1 stores its outputs in bf16 (the blocks' dtype), phase
    2 + RMSNorm reads them. Outputs and every gradient as accurate against float64 as the bf16 reference composition
    (which keeps phase 1's outputs in float32)."""
    D, N, Q, shape = 64, 4, 3, (4, 8)
    blocks64 = sources(N + 1, D, seed=61, dtype=torch.float64, shape=shape)
    queries, key_ws = vectors(D, 2, seed=62, rows=Q)
    norm_w = vectors(D, 2, seed=63)[1]
    cots = torch.randn(Q, *shape, D, generator=torch.Generator().manual_seed(64), dtype=torch.float64)
    results = {}
    for name, dtype in (("fused", torch.bfloat16), ("plain", torch.bfloat16), ("ref", torch.float64)):
        blocks = [b.detach().bfloat16().to(dtype).requires_grad_() for b in blocks64]
        pdt = torch.float32 if dtype == torch.bfloat16 else dtype
        params = [t.detach().to(pdt).requires_grad_() for t in (queries, key_ws, norm_w)]
        qs, kws, nw = params
        if name == "fused":
            out, lse = attn_res_partial_train(blocks[:-1], qs, kws, EPS)
            assert all(o.dtype == torch.bfloat16 for o in out) and lse.dtype == torch.float32
            xs = [attn_res_merge_norm_train(out[q], lse[q], blocks[-1], qs[q], kws[q], nw, EPS, NORM_EPS)
                  for q in range(Q)]  # fmt: skip
        else:
            parts = [naive_attn_res_partial(blocks[:-1], qs[q], kws[q], EPS) for q in range(Q)]
            xs = [
                rms_norm(naive_attn_res_merge(*parts[q], blocks[-1], qs[q], kws[q], EPS), nw, NORM_EPS)
                for q in range(Q)
            ]
        loss = sum((x.double() * cot).sum() for x, cot in zip(xs, cots, strict=True))
        results[name] = (torch.stack(xs).detach(), torch.autograd.grad(loss, [*blocks, *params]))
    (fo, fg), (po, pg), (ro, rg) = results["fused"], results["plain"], results["ref"]
    assert fo.dtype == torch.bfloat16
    assert_as_accurate("block bf16 out", fo, ro, po, floor=2**-8)
    labels = [f"block {i}" for i in range(N)] + ["partial", "queries", "key_weights", "norm_weight"]
    for label, f, p, r in zip(labels, fg, pg, rg, strict=True):
        assert f.dtype == p.dtype, label
        assert_as_accurate(f"block bf16 d {label}", f, r, p, floor=2**-8)


def test_partial_backward_reads_blocks_not_outputs():
    """Phase 1's backward sums dout_q . out_q over the blocks, never from the stored outputs (rounded to the blocks'
    dtype): outputs overwritten after the forward leave every gradient unchanged, bit for bit."""
    D, Q = 16, 2
    blocks = sources(3, D, seed=71)
    queries, key_ws = vectors(D, 2, seed=72, rows=Q)
    inputs = [*blocks, queries, key_ws]
    out, lse = attn_res_partial_train(blocks, queries, key_ws, EPS)
    kept = grads((*out, lse), inputs)
    out, lse = attn_res_partial_train(blocks, queries, key_ws, EPS)
    for o in out:
        o.data.fill_(float("nan"))
    for label, a, b in zip(["b0", "b1", "b2", "queries", "key_weights"], grads((*out, lse), inputs), kept, strict=True):
        assert torch.equal(a, b), label


def test_opcheck():
    D = 16
    src = sources(3, D, seed=31)
    query, key_w, norm_w = vectors(D, 3, seed=31)
    ops = torch.ops.hybrid_attention
    # Full AttnRes: kernel ops without autograd of their own (an autograd.Function holds them).
    src0, params0 = sources(3, D, seed=33, shape=(1, 2)), [p.detach() for p in (query, key_w, norm_w)]
    src0 = [s.detach() for s in src0]
    torch.library.opcheck(ops.attn_res_norm_fwd, (src0, *params0, EPS, NORM_EPS))
    x, stats = ops.attn_res_norm_fwd(src0, *params0, EPS, NORM_EPS)
    torch.library.opcheck(ops.attn_res_norm_bwd, (torch.randn_like(x), src0, *params0, stats, EPS))
    # A stream of K = 3 steps: step 1's forward, then its backward (newest source) into tables that step 2 filled;
    # bf16 sources keep h's rounding residual (float32 parameters and tables).
    queries, key_ws = (torch.stack([p, p.flip(0)]).repeat(2, 1)[:3].contiguous() for p in params0[:2])
    for dtype in (F64, torch.bfloat16):
        pdt = torch.float32 if dtype == torch.bfloat16 else dtype
        src_d, qs, kws, nw = [s.to(dtype) for s in src0], queries.to(pdt), key_ws.to(pdt), params0[2].to(pdt)
        torch.library.opcheck(ops.attn_res_stream_fwd, (src_d[:2], qs[1], kws[1], nw, EPS, NORM_EPS))
        x, h, h_res, stats, logits = ops.attn_res_stream_fwd(src_d[:2], qs[1], kws[1], nw, EPS, NORM_EPS)
        assert h_res.dtype == torch.int8 and h_res.numel() == (x.numel() if dtype == torch.bfloat16 else 0)
        shape = src0[0].shape
        splits, programs = param_table_rows(x.numel() // D, x.device)
        for dx in (torch.randn_like(x), None):
            k_split = early_steps(3)  # step 1's dh row in the early table, step 2's in the late one
            tables = (
                torch.randn(k_split, *shape, dtype=dtype, device=DEV),
                torch.randn(3 - k_split, *shape, dtype=dtype, device=DEV),
                torch.randn(3, 2 + 3, *shape[:-1], dtype=pdt, device=DEV),  # a stream of 3 sources
                torch.randn(1 + splits + programs, 3, D, dtype=pdt, device=DEV),
            )
            args = (dx, h, h_res, stats, logits, qs, kws, nw, src_d[1:2], *tables, 1, EPS)
            torch.library.opcheck(ops.attn_res_stream_bwd, args)
        torch.library.opcheck(ops.attn_res_stream_param_grads, (tables[3], splits))
    # Block AttnRes: kernel ops likewise, both phases each way.
    queries, key_ws = (t.detach() for t in vectors(D, 2, seed=32, rows=2))
    blocks, (q, kw, nw) = [s.detach() for s in src], (t.detach() for t in (query, key_w, norm_w))
    torch.library.opcheck(ops.attn_res_partial_fwd, (blocks, queries, key_ws, EPS))
    out, lse = ops.attn_res_partial_fwd(blocks, queries, key_ws, EPS)
    bwd_args = ([torch.randn_like(o) for o in out], torch.randn_like(lse), blocks, queries, key_ws, lse, EPS)
    torch.library.opcheck(ops.attn_res_partial_bwd, bwd_args)
    for partial in (blocks[0], None):
        args = (out[0], lse[0], partial, q, kw, nw, EPS, NORM_EPS, F64)
        torch.library.opcheck(ops.attn_res_merge_norm_fwd, args)
        x, rho = ops.attn_res_merge_norm_fwd(*args)
        args = (torch.randn_like(x), out[0], lse[0], partial, q, kw, nw, rho, EPS)
        torch.library.opcheck(ops.attn_res_merge_norm_bwd, args)


def test_bad_inputs():
    D = 16
    src = sources(2, D)
    query, key_w, norm_w = vectors(D, 3)
    with pytest.raises(ValueError, match="non-empty list"):
        attn_res_norm_train([], query, key_w, norm_w)
    with pytest.raises(ValueError, match="non-empty list"):
        attn_res_norm_train(torch.stack(src), query, key_w, norm_w)
    with pytest.raises(ValueError, match="like source 0"):
        attn_res_norm_train([src[0], src[1][:, :2]], query, key_w, norm_w)
    with pytest.raises(ValueError, match="like source 0"):
        attn_res_norm_train([src[0], src[1].half()], query, key_w, norm_w)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[16\]"):
        attn_res_norm_train(src, query, key_w, norm_w[:4])
    with pytest.raises(ValueError, match=r"queries must have shape \[Q, 16\]"):
        attn_res_partial_train(src, query, key_w)
    with pytest.raises(ValueError, match="pass dtype"):
        attn_res_merge_norm_train(src[0], src[0][..., 0], None, query, key_w, norm_w)
    strided = src[1].transpose(0, 1).contiguous().transpose(0, 1)
    queries, key_ws, norm_ws = torch.stack([query, query]), torch.stack([key_w, key_w]), torch.stack([norm_w, norm_w])
    x, carrier = attn_res_norm_stream_start(src[:1], queries, key_ws, norm_ws)
    with pytest.raises(ValueError, match="previous step's 1 sources and one more, got 3"):
        attn_res_norm_step([*src, src[0]], carrier)
    with pytest.raises(ValueError, match="newest source must be"):
        attn_res_norm_step([src[0], src[1].half()], carrier)
    with pytest.raises(ValueError, match="newest source must be contiguous"):
        attn_res_norm_step([src[0], strided], carrier)
    x, last = attn_res_norm_step(src, carrier)
    with pytest.raises(ValueError, match="started for 2 steps"):
        attn_res_norm_step([*src, src[0]], last)
    with pytest.raises(ValueError, match="source 1 must be contiguous"):
        attn_res_norm_stream_start([src[0], strided], queries, key_ws, norm_ws)
    with pytest.raises(ValueError, match=r"key_weights must have shape \[K, 16\]"):
        attn_res_norm_stream_start(src, queries, key_ws[:1], norm_ws)
    with pytest.raises(ValueError, match=r"norm_weights must have shape \[K, 16\]"):
        attn_res_norm_stream_start(src, queries, key_ws, norm_ws[:, :4])


def _off_boundary(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element past a 16-byte boundary (a view into a larger tensor)."""
    flat = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t.detach())
    return view.requires_grad_()


def test_sources_off_16_byte_boundaries():
    """Sources the kernels cannot read as 16-byte vectors (views that start mid-vector) take the unhinted kernels
    (`table_alignment` 1) and give the same outputs and gradients, bit for bit, as aligned copies (16)."""
    from hybrid_attention.ops.attnres.rows import table_alignment

    D = 16
    aligned = sources(4, D, seed=81)
    shifted = [_off_boundary(s) for s in aligned]
    assert table_alignment(aligned) == 16 and table_alignment(shifted) == 1
    query, key_w, norm_w = vectors(D, 3, seed=81)
    queries, key_ws, norm_ws = vectors(D, 3, seed=82, rows=3)
    results = {}
    for name, src in (("aligned", aligned), ("shifted", shifted)):
        full = attn_res_norm_train(src, query, key_w, norm_w, EPS, NORM_EPS)
        x0, carrier = attn_res_norm_stream_start(src[:2], queries, key_ws, norm_ws, EPS, NORM_EPS)
        x1, _ = attn_res_norm_step(src[:3], carrier, NORM_EPS)
        out, lse = attn_res_partial_train(src[:3], queries, key_ws, EPS)
        outs = (full, x0, x1, *out, lse)
        results[name] = (outs, grads(outs, [*src, query, key_w, norm_w, queries, key_ws, norm_ws]))
    (a_out, a_grads), (s_out, s_grads) = results["aligned"], results["shifted"]
    for i, (a, s) in enumerate(zip(a_out, s_out, strict=True)):
        assert torch.equal(a, s), f"output {i}"
    for i, (a, s) in enumerate(zip(a_grads, s_grads, strict=True)):
        assert (a is None and s is None) or torch.equal(a, s), f"gradient {i}"


def test_chain_without_rows():
    """A stream over sources with no rows (an empty batch): empty outputs, empty source gradients, and zero
    gradients for every step's parameters, as the reference gives."""
    S, D = 4, 16
    src = [torch.randn(2, 0, D, dtype=F64, device=DEV).requires_grad_() for _ in range(S)]
    params = [vectors(D, 3, seed=90 + l) for l in range(2, S + 1)]
    outs = run_chain(src, params, 2, range(2, S + 1))
    assert all(o.shape == (2, 0, D) for o in outs)
    flat = [p for ps in params for p in ps]
    got = torch.autograd.grad(sum(o.sum() for o in outs), src + flat)  # None for any input would fail here
    assert all(g.shape == (2, 0, D) for g in got[:S])
    for i, g in enumerate(got[S:]):
        assert torch.equal(g, torch.zeros_like(g)), f"parameter {i}: {g}"


@pytest.mark.parametrize("used_last", [True, False])
def test_early_dh_table_allocated_late(used_last, monkeypatch, poisoned):
    """The stream's backward allocates its late dh table (the last quarter of the steps) first, and the early one
    only when it reaches an early step, after the later steps' backwards have run (so the whole dh never sits on the
    memory peak at the backward's start); with NaN-poisoned allocations, the entries of steps whose backward never
    runs must be zeroed for the gradients to match the reference."""
    from hybrid_attention.ops.attnres import full_stream

    S, D, start = 9, 16, 2
    K = S - start + 1
    k_split = full_stream.early_steps(K)
    allocated, backward_steps = [], []
    make_table, run_backward = full_stream._dh_table, full_stream._bwd

    def recording_table(h, steps, live):
        allocated.append((steps, len(backward_steps)))  # the table's size, and how many backwards ran before it
        return make_table(h, steps, live)

    def recording_backward(*args):
        backward_steps.append(args[-2])
        return run_backward(*args)

    monkeypatch.setattr(full_stream, "_dh_table", recording_table)
    monkeypatch.setattr(full_stream, "_bwd", recording_backward)
    used = range(start, S + 1) if used_last else range(start, S - 2)  # without the last three: a dead late table
    src = sources(S, D, seed=95, shape=(1, 2))
    params = [vectors(D, 3, seed=95 + l) for l in range(start, S + 1)]
    outs = run_chain(src, params, start, used)
    fused = grads(outs, src)
    src64, params64 = f64(src), [f64(p) for p in params]
    check_grads("two dh tables", fused, grads(reference_chain(src64, params64, start, used), src64), range(S))
    first = backward_steps[0]
    assert first == used[-1] - start, backward_steps
    assert len(allocated) == 2 and allocated[0] == (K - k_split, 0), allocated  # the late table, first
    # The early table: by the first backward of an early step, after every later step's backward (none when the
    # first backward is an early step's).
    later = sum(s >= k_split for s in backward_steps)
    assert allocated[1] == (k_split, later) and (later > 0) == (first >= k_split), (allocated, backward_steps)
