"""Triton KDA kernels on a CUDA GPU over their whole input domain, at real sizes.

Decays far below -5 per step (down to -1000) and the unbounded softplus gate against the float64 recurrence; fp16
and bf16 at T = 2048 and 4096 with tolerances stated as FLA states them (relative RMS error, the RMS of the
difference over the RMS of the reference); bitwise repeatable backward, also across every autotune config; and a
poisoned future that leaves the past bit-identical.

    python -m pytest -q -s tests/gpu/test_kda_domain.py
"""

from __future__ import annotations

import pytest
import torch

from tests.kda_triton_cases import CONFIG_CASES, force_config, make_inputs, reference_kda, run, triton_kda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16, FP16 = torch.bfloat16, torch.float16
RMS_TOL = 0.008  # FLA's test_chunk tolerance for float16 and bfloat16, relative RMS error of every output and gradient


def rms_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sqrt(mean((out - ref)^2)) / sqrt(mean(ref^2)), in float64; inf when out holds NaN or inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))


def draws(inputs, seed=1000):
    q, v = inputs[0], inputs[2]
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(v.shape, dtype=torch.float64, generator=gen).cuda()
    dS = torch.randn(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64, generator=gen).cuda()
    return do, dS


def check_rms(name, inputs, tol=RMS_TOL, skip=(), **kw):
    do, dS = draws(inputs)
    o, S, grads = run(triton_kda, inputs, do, dS, **kw)
    ro, rS, rgrads = run(reference_kda, inputs, do, dS, **kw)
    errors = {"o": rms_ratio(o, ro), "final": rms_ratio(S, rS)}
    errors.update({f"d{n}": rms_ratio(grads[n], r) for n, r in rgrads.items() if n not in skip})
    print(f"[kda_domain] {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    failed = {k: v for k, v in errors.items() if not v < tol}
    assert not failed, f"{name}: relative RMS error over {tol}: {failed}"


def extreme_decays(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = -5.0 * torch.rand(shape, generator=gen, dtype=torch.float64)
    g[:, torch.rand(shape[1], generator=gen) < 0.03] = -1000.0  # masked tokens, as FLA's tests use
    g[torch.rand(shape, generator=gen) < 0.05] = -50.0
    g[torch.rand(shape, generator=gen) < 0.05] = -12.0
    return g


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T", [2048, 4096])
def test_decays_down_to_minus_1000(dtype, T):
    inputs = list(make_inputs(2, T, 4, 128, 128, dtype=dtype, seed=T))
    inputs[3] = extreme_decays(inputs[3].shape, seed=T).to(dtype).cuda()
    # dg is the difference of terms of the size of q dq and k dk, and small where the decay is strong: its relative
    # RMS error is not a meaningful number here (the CPU tests bound it against those terms).
    check_rms(f"extreme decays {dtype} T={T}", inputs, skip=("g",))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T", [2048, 4096])
def test_softplus_gate(dtype, T):
    inputs = make_inputs(2, T, 4, 128, 128, dtype=dtype, gate="softplus", l2norm=True, seed=T + 1)
    check_rms(f"softplus gate {dtype} T={T}", inputs, l2norm=True, form="softplus", skip=("g",))


def test_fp16_fla_test_chunk_case():
    """FLA's test_chunk case: B=4, T=2048, H=8, D=64, fp16, bounded gate in the kernel with random A_log, dt_bias,
    lower bound -5, q/k l2norm in the kernel: every output and gradient within 0.008 relative RMS error."""
    inputs = make_inputs(4, 2048, 8, 64, 64, dtype=FP16, gate=True, l2norm=True, seed=7)
    check_rms("FLA test_chunk fp16", inputs, l2norm=True)


def test_backward_bitwise_repeatable_across_runs_and_configs(monkeypatch):
    """Two backward passes give the same bits, and so does every autotune config of every kernel (the tuner's
    choice never changes the order of a sum), at a real shape in bf16."""
    inputs = make_inputs(2, 1000, 4, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=8)
    do, dS = draws(inputs)
    base = run(triton_kda, inputs, do, dS, l2norm=True)
    again = run(triton_kda, inputs, do, dS, l2norm=True)
    assert torch.equal(base[0], again[0]) and all(torch.equal(base[2][n], again[2][n]) for n in base[2])
    for kernel, index in CONFIG_CASES:
        with monkeypatch.context() as m:
            force_config(m, kernel, index)
            other = run(triton_kda, inputs, do, dS, l2norm=True)
        if kernel == "output":  # the separate output pass multiplies the same rounded operands
            assert torch.equal(base[0], other[0]), kernel
        for name, x in base[2].items():
            assert torch.equal(x, other[2][name]), f"{kernel} config {index}: d{name} differs"


@pytest.mark.parametrize("name", ["k", "v", "g", "beta"])
def test_poisoned_future(name):
    t = 1500
    inputs = make_inputs(2, 4096, 4, 128, 128, dtype=BF16, gate=True, l2norm=True, seed=9)
    with torch.no_grad():
        o, _ = triton_kda(*inputs, l2norm=True)
        poisoned = list(inputs)
        i = ["q", "k", "v", "g", "beta"].index(name)
        poisoned[i] = inputs[i].clone()
        poisoned[i][1, t] = float("nan")
        o2, _ = triton_kda(*poisoned, l2norm=True)
    assert torch.equal(o2[0], o[0]) and torch.equal(o2[1, :t], o[1, :t])
    assert not torch.isfinite(o2[1, t:]).any()
