"""GPU smoke test of the KDA ops at a realistic size (bf16, B=2, T=1000, H=4, K=V=128, fp32 initial state).

chunk_kda(backend="torch") is compared with recurrent_kda run in float32 on the same values, and
flash-linear-attention's chunk_kda (backend="fla", when `fla` is importable) with ours, forward and backward.
Relative errors are printed (`pytest -s`).

    python -m pytest -q -s tests/gpu/ops/kda/test_smoke_gpu.py
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import chunk_kda, kda_gate, recurrent_kda
from tests.helpers import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HAS_FLA = importlib.util.find_spec("fla") is not None
B, T, H, K, V = 2, 1000, 4, 128, 128
OUT_TOL, GRAD_TOL = 1e-2, 2e-2
NAMES = ("q", "k", "v", "g", "beta", "h0")


def record(case: str, quantity: str, err: float, tol: float) -> tuple[str, float, float]:
    print(f"[kda_smoke] {case:<28} {quantity:<8} rel_err={err:.3e} (tol {tol:.0e})")
    return quantity, err, tol


def check(results: list[tuple[str, float, float]]) -> None:
    """Assert after recording everything, so one failure does not hide the other numbers."""
    failed = [f"{q}: {e:.3e} >= {t:.0e}" for q, e, t in results if not (e < t)]  # NaN/inf fail too
    assert not failed, "; ".join(failed)


def make_inputs(batch: int = B, seqlen: int = T, n_states: int = B):
    """bf16 q, k (L2-normalised), v; fp32 g from the bounded gate (in (-5, 0)) and fp32 beta; fp32 state."""
    dev = "cuda"
    q = F.normalize(torch.randn(batch, seqlen, H, K, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(batch, seqlen, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(batch, seqlen, H, V, device=dev).bfloat16()
    dt = torch.exp(torch.rand(H * K, device=dev) * math.log(100.0) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = kda_gate(2.0 * torch.randn(batch, seqlen, H, K, device=dev), torch.zeros(H, device=dev), dt_bias)
    beta = torch.rand(batch, seqlen, H, device=dev)
    h0 = torch.randn(n_states, H, K, V, device=dev)
    assert (g > -5).all() and (g < 0).all()
    return [q, k, v, g, beta, h0]


def forward_backward(fn, inputs, do, dS, cast=None, **kwargs):
    """o, S and the gradients of (o . do + S . dS) with respect to every input (leaf copies, optionally cast)."""
    leaves = [(x if cast is None else x.to(cast)).detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = leaves
    o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
    grads = torch.autograd.grad((o.float() * do).sum() + (S * dS).sum(), leaves)
    return o.detach(), S.detach(), dict(zip(NAMES, grads, strict=True))


def torch_chunk(*args, **kwargs):
    return chunk_kda(*args, backend="torch", **kwargs)


def fla_chunk(*args, **kwargs):
    return chunk_kda(*args, backend="fla", **kwargs)


def test_torch_chunk_matches_float32_recurrent():
    torch.manual_seed(0)
    inputs = make_inputs()
    do, dS = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    ref_o, ref_S, ref_grads = forward_backward(recurrent_kda, inputs, do, dS, cast=torch.float32)
    o, S, grads = forward_backward(torch_chunk, inputs, do, dS)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    results = [
        record("torch_vs_recurrent_fp32", "o", rel_err(o, ref_o), OUT_TOL),
        record("torch_vs_recurrent_fp32", "state", rel_err(S, ref_S), OUT_TOL),
    ]
    results += [record("torch_vs_recurrent_fp32", f"d{n}", rel_err(grads[n], ref_grads[n]), GRAD_TOL) for n in NAMES]
    check(results)


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla) is not importable")
@pytest.mark.parametrize("chunk_size", [64, 32])
def test_fla_matches_torch_chunk(chunk_size):
    torch.manual_seed(1)
    inputs = make_inputs()
    do, dS = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    ref_o, ref_S, ref_grads = forward_backward(torch_chunk, inputs, do, dS, chunk_size=chunk_size)
    o, S, grads = forward_backward(fla_chunk, inputs, do, dS, chunk_size=chunk_size)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    case = f"fla_vs_torch_c{chunk_size}"
    results = [record(case, "o", rel_err(o, ref_o), OUT_TOL), record(case, "state", rel_err(S, ref_S), OUT_TOL)]
    results += [record(case, f"d{n}", rel_err(grads[n], ref_grads[n]), GRAD_TOL) for n in NAMES]
    check(results)


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla) is not importable")
def test_fla_matches_torch_chunk_varlen():
    """Packed sequences with int32 cu_seqlens (our FLA wrapper converts them to int64)."""
    torch.manual_seed(2)
    cu = torch.tensor([0, 100, 457, 1000], dtype=torch.int32, device="cuda")
    inputs = make_inputs(batch=1, n_states=3)
    kwargs = dict(initial_state=inputs[5], output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        ref_o, ref_S = chunk_kda(*inputs[:5], backend="torch", **kwargs)
        o, S = chunk_kda(*inputs[:5], backend="fla", **kwargs)
    check([record("fla_vs_torch_varlen", "o", rel_err(o, ref_o), OUT_TOL),
           record("fla_vs_torch_varlen", "state", rel_err(S, ref_S), OUT_TOL)])  # fmt: skip
