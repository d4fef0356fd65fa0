"""Triton KDA kernels on a CUDA GPU against `recurrent_kda` run in float64 on the same (rounded) values.

Outputs, final states and every gradient (q, k, v, g or z, beta, initial state, A_log, dt_bias) for odd lengths
(1, 63, 65, 1000, 4097), K, V of 64, 128, 100 x 60 and 256, varlen, the fused gate and l2norm, bf16 / fp16 /
fp32; the gate at its bound for 16K tokens; bitwise prefix invariance; NaN-poisoned buffers; the decode step;
torch.compile (inductor); and FLA 0.6.0 side by side when it is installed. Tolerances (relative L2 error):
bf16 / fp16 1e-2 on outputs and states, 2e-2 on gradients (or, as FLA's tests allow, a largest absolute error of at
most 1e-6); fp32 1e-5. Every error is printed (`-s`); a test asserts only after checking all of its numbers.

    python -m pytest -q -s tests/gpu/ops/kda/test_triton_gpu.py

Each kernel runs its first config (`first_configs_only`, far fewer compiles) except where a test forces another;
tests/gpu/ops/kda/test_domain_gpu.py runs them autotuned, as in use.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybrid_attention.ops.triton_cache import first_configs_only
from tests.helpers import HALF_ABS_FLOOR, max_abs_err, rel_err
from tests.ops.kda.cases import (
    ALL_CONFIG_CASES,
    CONFIG_CASES,
    changed_after,
    extreme_decays,
    force_config,
    force_output_pass,
    make_inputs,
    poison_torch_empty,
    reference_kda,
    run,
    triton_kda,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HAS_FLA = importlib.util.find_spec("fla") is not None
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOL = {BF16: (1e-2, 2e-2), FP16: (1e-2, 2e-2), FP32: (1e-5, 1e-5)}


@pytest.fixture(autouse=True)
def _first_configs():
    with first_configs_only():
        yield


def record(case, quantity, err, tol, abs_err=None):
    """One checked number; `abs_err` (half precision only) also passes it at most HALF_ABS_FLOOR, as FLA's tests do."""
    shown = "" if abs_err is None else f" max abs {abs_err:.1e}"
    print(f"[kda_triton] {case:<44} {quantity:<10} rel_err={err:.3e} (tol {tol:.0e}){shown}")
    return quantity, err, tol, abs_err


def check(results):
    failed = [
        f"{q}: {e:.3e} >= {t:.0e}" + ("" if a is None else f" and max abs {a:.1e} > {HALF_ABS_FLOOR:.0e}")
        for q, e, t, a in results
        if not (e < t or (a is not None and a <= HALF_ABS_FLOOR))  # NaN / inf fail too
    ]
    assert not failed, "; ".join(failed)


def compare(case, inputs, fn=triton_kda, **kw):
    """Record (and return) the relative errors of fn against the float64 reference_kda, forward and backward (in
    half precision with the largest absolute error beside them)."""
    q, v = inputs[0], inputs[2]
    tol_o, tol_g = TOL[q.dtype]
    N = q.shape[0] if kw.get("cu_seqlens") is None else kw["cu_seqlens"].numel() - 1
    do = torch.randn(v.shape, dtype=torch.float64, device="cuda")
    dS = torch.randn(N, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64, device="cuda")
    results = []
    try:
        o, S, grads = run(fn, inputs, do, dS, **kw)
    except Exception as exc:  # report, then fail
        record(case, f"ERROR {type(exc).__name__}", float("inf"), 0.0)
        raise
    ro, rS, rgrads = run(reference_kda, inputs, do, dS, **kw)
    half = q.dtype in (BF16, FP16)
    abs_err = lambda x, r: max_abs_err(x, r) if half else None  # noqa: E731
    results.append(record(case, "o", rel_err(o, ro), tol_o, abs_err(o, ro)))
    results.append(record(case, "final", rel_err(S, rS), tol_o, abs_err(S, rS)))
    for name, ref in rgrads.items():
        tol = tol_g
        if name == "A_log":  # a sum with cancellation: error of dz times the sum's condition number
            terms = rgrads["g"] * (inputs[3].double() + inputs[7].double().view(q.shape[2], -1))
            tol *= float((terms.abs().sum((0, 1, 3)) / ref.abs().clamp_min(1e-30)).max())
        got = grads.get(name, torch.full_like(ref, float("nan")))
        results.append(record(case, f"d{name}", rel_err(got, ref), tol, abs_err(got, ref)))
    return results


SHAPES = [  # B, T, H, K, V, with initial state
    (2, 1, 4, 128, 128, True),
    (2, 63, 4, 128, 128, False),
    (2, 65, 4, 128, 128, True),
    (2, 1000, 4, 128, 128, True),
    (1, 4097, 2, 128, 128, True),
]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[1]}" for s in SHAPES])
def test_lengths(shape, dtype):
    B, T, H, K, V, h0 = shape
    check(compare(f"{dtype} B{B} T{T} H{H} K{K} V{V} h0={h0}", make_inputs(B, T, H, K, V, dtype=dtype, h0=h0, seed=T)))


@pytest.mark.parametrize(
    "dtype, K, V", [(BF16, 64, 64), (BF16, 100, 60), (BF16, 256, 256), (FP16, 128, 128), (FP32, 64, 64)]
)
def test_sizes_and_dtypes(dtype, K, V):
    T = 300 if K <= 128 else 200
    check(compare(f"{dtype} B1 T{T} H2 K{K} V{V}", make_inputs(1, T, 2, K, V, dtype=dtype, seed=K + V)))


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_varlen(dtype):
    cu = torch.tensor([0, 15, 100, 300, 1200, 2000], device="cuda")
    inputs = make_inputs(1, 2000, 4, 128, 128, dtype=dtype, N=5, seed=1)
    check(compare(f"{dtype} varlen {cu.tolist()}", inputs, cu_seqlens=cu))


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_fused_gate_and_l2norm(dtype):
    inputs = make_inputs(2, 1000, 4, 128, 128, dtype=dtype, gate=True, l2norm=True, seed=2)
    check(compare(f"{dtype} gate+l2norm B2 T1000", inputs, l2norm=True))


# Every config but the first of every autotuned kernel (the first runs in all other tests). A config that faults or
# miscomputes at one size only must not be left for the autotuner to find: a (BV 32, 2 stages) state backward
# config faulted at K = V = 64 in a benchmark while every test here passed with the first configs. The forward's
# kernels run with O inside the walk and in the output pass (the walk's programs differ: OUT in or out).
@pytest.mark.parametrize("size", [64, 128])
@pytest.mark.parametrize("kernel, index", CONFIG_CASES, ids=[f"{n}-{i}" for n, i in CONFIG_CASES])
def test_every_autotune_config(kernel, index, size, monkeypatch):
    config = force_config(monkeypatch, kernel, index)
    inputs = make_inputs(1, 300, 2, size, size, dtype=BF16, gate=True, l2norm=True, seed=size + index)
    passes = [True] if kernel == "output" else [False, True]
    results = []
    for split in passes:
        force_output_pass(monkeypatch, split)
        name = f"{kernel} config {config} K=V={size} {'split' if split else 'walk'}"
        results += compare(name, inputs, l2norm=True)
    check(results)


# Every config, the first included, in float16 with decays down to -1000: the autotuner keys on the dtype, so a float16
# run may pick a config that no bfloat16 test exercises, and float16's narrow range is where the decay handling is
# tightest. dg is skipped as in tests/gpu/ops/kda/test_domain_gpu.py (small where the decay is strong: its relative
# error measures conditioning); d initial_state, the quantity such decays make smallest, is checked.
@pytest.mark.parametrize("size", [64, 128])
@pytest.mark.parametrize("kernel, index", ALL_CONFIG_CASES, ids=[f"{n}-{i}" for n, i in ALL_CONFIG_CASES])
def test_every_autotune_config_fp16_extreme_decays(kernel, index, size, monkeypatch):
    config = force_config(monkeypatch, kernel, index)
    inputs = list(make_inputs(2, 300, 2, size, size, dtype=FP16, seed=size + index))
    inputs[3] = extreme_decays(inputs[3].shape, seed=size + index).to(FP16).cuda()
    passes = [True] if kernel == "output" else [False, True]
    results = []
    for split in passes:
        force_output_pass(monkeypatch, split)
        name = f"{kernel} config {config} K=V={size} fp16 extreme {'split' if split else 'walk'}"
        results += [r for r in compare(name, inputs) if r[0] != "dg"]
    check(results)


@pytest.mark.parametrize("case", ["T4097", "varlen"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "walk"])
def test_output_pass(split, case, monkeypatch):
    """The forward with O in the separate per-chunk pass (split) or inside the state walk (walk, the default above
    32 (sequence, head) pairs), bf16, against the reference."""
    force_output_pass(monkeypatch, split)
    mode, seed = ("split", 21) if split else ("walk", 23)
    if case == "varlen":
        cu = torch.tensor([0, 15, 100, 300, 1200, 2000], device="cuda")
        inputs = make_inputs(1, 2000, 4, 128, 128, dtype=BF16, N=5, gate=True, l2norm=True, seed=seed)
        check(compare(f"{mode} output varlen", inputs, cu_seqlens=cu, l2norm=True))
    else:
        inputs = make_inputs(1, 4097, 2, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=seed + 1)
        check(compare(f"{mode} output B1 T4097 H2", inputs, l2norm=True))


def test_gate_at_bound_16k_stays_finite():
    """z so large that every gate sits at lower_bound = -5 exactly, for 16K tokens: all finite, and the
    forward still matches the reference."""
    B, T, H, K, V = 1, 16384, 2, 128, 128
    q, k, v, _, beta, h0, A_log, dt_bias = make_inputs(B, T, H, K, V, dtype=BF16, gate=True, l2norm=True, seed=3)
    z = torch.full((B, T, H, K), 50.0, device="cuda", dtype=BF16)
    inputs = [q, k, v, z, beta, h0, torch.zeros_like(A_log), torch.zeros_like(dt_bias)]
    do = torch.randn(B, T, H, V, dtype=torch.float64, device="cuda")
    dS = torch.randn(B, H, K, V, dtype=torch.float64, device="cuda")
    o, S, grads = run(triton_kda, inputs, do, dS, l2norm=True)
    with torch.no_grad():
        ro, rS = reference_kda(*inputs, l2norm=True)
    case = "gate at bound T16384"
    results = [record(case, "o", rel_err(o, ro), 1e-2), record(case, "final", rel_err(S, rS), 1e-2)]
    for name, x in grads.items():
        results.append(record(case, f"d{name} finite", 0.0 if torch.isfinite(x).all() else 1.0, 0.5))
    check(results)


@pytest.mark.parametrize("t", [37, 150, 255])
def test_prefix_invariance(t):
    """Inputs after t changed, loss on outputs up to t: outputs and gradients up to t are bitwise unchanged."""
    T = 300
    base = make_inputs(1, T, 2, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=4)
    other = make_inputs(1, T, 2, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=5)
    do = torch.randn(1, T, 2, 128, dtype=torch.float64, device="cuda")
    do[:, t + 1 :] = 0
    dS = torch.zeros(1, 2, 128, 128, dtype=torch.float64, device="cuda")
    (o1, _, g1), (o2, _, g2) = (run(triton_kda, x, do, dS, l2norm=True) for x in (base, changed_after(base, other, t)))
    same = {"o": torch.equal(o1[:, : t + 1], o2[:, : t + 1])}
    same.update({n: torch.equal(g1[n][:, : t + 1], g2[n][:, : t + 1]) for n in ("q", "k", "v", "g", "beta")})
    same.update({n: torch.equal(g1[n], g2[n]) for n in ("h0", "A_log", "dt_bias")})
    check([record(f"prefix t={t}", n, 0.0 if ok else 1.0, 0.5) for n, ok in same.items()])
    assert not torch.equal(o1, o2)


def test_poisoned_buffers(monkeypatch):
    poison_torch_empty(monkeypatch)
    cu = torch.tensor([0, 7, 64, 65, 500], device="cuda")
    inputs = make_inputs(1, 500, 2, 128, 128, dtype=BF16, N=4, gate=True, l2norm=True, seed=6)
    check(compare("bf16 NaN-poisoned varlen gate+l2norm", inputs, cu_seqlens=cu, l2norm=True))


@pytest.mark.parametrize("B, H, T", [(64, 4, 1), (64, 4, 4), (256, 16, 1)])
def test_decode_step(B, H, T):
    from hybrid_attention.ops.kda.triton_step import fused_recurrent_kda_step

    q, k, v, z, beta, h0, A_log, dt_bias = make_inputs(B, T, H, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=7)
    state = h0.clone()
    o = fused_recurrent_kda_step(q, k, v, z, beta, state, gate="bounded", A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=-5.0, use_qk_l2norm=True)  # fmt: skip
    ro, rS = reference_kda(q, k, v, z, beta, h0, A_log, dt_bias, l2norm=True)
    case = f"decode B{B} H{H} T{T} gate+l2norm"
    check([record(case, "o", rel_err(o, ro), 1e-2), record(case, "state", rel_err(state, rS), 1e-5)])


def test_prefill_then_decode():
    from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton
    from hybrid_attention.ops.kda.triton_step import fused_recurrent_kda_step

    q, k, v, z, beta, h0, A_log, dt_bias = make_inputs(4, 203, 4, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=8)
    gate = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm=True)
    with torch.no_grad():
        full, _ = chunk_kda_triton(q, k, v, z, beta, initial_state=h0, **gate)
        pre, state = chunk_kda_triton(q[:, :200], k[:, :200], v[:, :200], z[:, :200], beta[:, :200],
                                      initial_state=h0, output_final_state=True, **gate)  # fmt: skip
        steps = [fused_recurrent_kda_step(*(x[:, t : t + 1] for x in (q, k, v, z, beta)), state, **gate)
                 for t in range(200, 203)]  # fmt: skip
    check([record("prefill 200 + 3 decode steps", "o", rel_err(torch.cat([pre, *steps], 1), full), 1e-2)])


def test_auto_backend_on_cuda_by_dtype():
    """ "auto" takes the Triton kernels for the CUDA dtypes they support and the reference for float64 (which the
    kernels reject), so a float64 CUDA model still runs."""
    from hybrid_attention.ops.kda import resolve_backend

    for dtype, expected in ((torch.bfloat16, "triton"), (torch.float32, "triton"), (torch.float64, "torch")):
        assert resolve_backend("auto", torch.zeros(1, device="cuda", dtype=dtype)) == expected
    assert resolve_backend("auto", torch.zeros(1, device="cuda"), chunk_size=32) == "torch"


def test_torch_compile_inductor():
    """The custom ops inside a compiled function (inductor, fullgraph): same values as eager."""
    inputs = make_inputs(2, 500, 4, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=9)

    def fn(q, k, v, g, beta, h0, A_log, dt_bias):
        o, S = triton_kda(q * 2, k, v, g, beta, h0, A_log, dt_bias, l2norm=True)  # exact pre/post ops: bitwise equal
        return o * 2, S

    do = torch.randn(2, 500, 4, 128, dtype=torch.float64, device="cuda")
    dS = torch.randn(2, 4, 128, 128, dtype=torch.float64, device="cuda")
    eo, eS, eg = run(fn, inputs, do, dS)
    co, cS, cg = run(torch.compile(fn, fullgraph=True), inputs, do, dS)
    case = "torch.compile (inductor) vs eager"
    results = [record(case, "o", rel_err(co, eo), 1e-6), record(case, "final", rel_err(cS, eS), 1e-6)]
    results += [record(case, f"d{n}", rel_err(cg[n], x), 1e-6) for n, x in eg.items()]
    check(results)


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla) not installed")
def test_against_fla():
    """FLA 0.6.0 chunk_kda in its fastest configuration, and ours, both against the float64 reference."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    def fla_fn(q, k, v, g, beta, h0, A_log, dt_bias, *, l2norm):
        assert l2norm  # FLA normalises q and k in its kernel, as we do here
        flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
        return fla_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                             dt_bias=dt_bias, **flags)  # fmt: skip

    inputs = make_inputs(2, 1000, 4, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=10)
    mine = compare("ours bf16 gate+l2norm (FLA config)", inputs, l2norm=True)
    theirs = compare("FLA 0.6.0 bf16 gate+l2norm", inputs, fn=fla_fn, l2norm=True)
    del theirs  # FLA's errors are recorded for comparison only
    check(mine)
