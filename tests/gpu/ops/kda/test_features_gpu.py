"""KDA op features on a CUDA GPU at real shapes: more value heads than query/key heads (GVA), the per-chunk states,
beta as logits, chunk_size 32 under "auto", and the decode step over a pool of states (also inside a CUDA graph);
FLA 0.6.0 side by side when it is installed.

The reference is the PyTorch chunkwise form in float64 on the same (rounded) values, which
tests/ops/kda/test_features.py holds to `recurrent_kda` at 1e-12; GVA is checked against one reference call per
value head. Tolerances (relative L2 error) as tests/gpu/ops/kda/test_triton_gpu.py: bf16 1e-2 on outputs and
states, 2e-2 on gradients; fp32 1e-5.

    python -m pytest -q -s tests/gpu/ops/kda/test_features_gpu.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import chunk_kda, kda_decode_step
from hybrid_attention.ops.triton_cache import first_configs_only
from tests.helpers import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HAS_FLA = importlib.util.find_spec("fla") is not None
BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: (1e-2, 2e-2), FP32: (1e-5, 1e-5)}
NAMES = ("q", "k", "v", "g", "beta", "h0")


@pytest.fixture(autouse=True)
def _first_configs():
    """Each kernel runs its first config: these tests check values, and tuning would only add compilations."""
    with first_configs_only():
        yield


def make(B, T, Hqk, Hv, K, V, *, dtype, seed, N=None, logits=False):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = F.normalize(rnd(B, T, Hqk, K), dim=-1), F.normalize(rnd(B, T, Hqk, K), dim=-1)
    g = -5 * torch.rand(B, T, Hv, K, generator=gen, dtype=torch.float64)
    beta = 3 * rnd(B, T, Hv) if logits else torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    x = [t.to(dtype).cuda() for t in (q, k, rnd(B, T, Hv, V), g, beta)]
    return x + [rnd(N or B, Hv, K, V).float().cuda()]


def reference(q, k, v, g, beta, h0, *, cu_seqlens=None, chunk_size=64, logits=False, states=False):
    """float64 PyTorch chunkwise form on the same values, q and k repeated to the value heads by index j // G."""
    x = [t.double() for t in (q, k, v, g, beta, h0)]
    G = v.shape[2] // q.shape[2]
    x[0], x[1] = (torch.cat([t[:, :, j // G : j // G + 1] for j in range(v.shape[2])], dim=2) for t in x[:2])
    if logits:
        x[4] = torch.sigmoid(x[4])
    return chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu_seqlens,
                     chunk_size=chunk_size, backend="torch", return_chunk_states=states)  # fmt: skip


def record(case, quantity, err, tol):
    print(f"[kda_features] {case:<40} {quantity:<8} rel_err={err:.3e} (tol {tol:.0e})")
    return quantity, err, tol


def check(results):
    failed = [f"{q}: {e:.3e} >= {t:.0e}" for q, e, t in results if not (e < t)]
    assert not failed, "; ".join(failed)


def with_grads(fn, inputs, seed=1):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves)[:2]
    gen = torch.Generator().manual_seed(seed)
    dO = torch.randn(o.shape, generator=gen, dtype=torch.float64).cuda()
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).cuda()
    grads = torch.autograd.grad((o.double() * dO).sum() + (S.double() * dS).sum(), leaves)
    return o, S, dict(zip(NAMES, grads, strict=True))


def compare(case, fn, inputs, ref_kw=None):
    tol_o, tol_g = TOL[inputs[0].dtype]
    o, S, grads = with_grads(fn, inputs)
    ro, rS, rgrads = with_grads(lambda *x: reference(*x, **(ref_kw or {})), inputs)
    results = [record(case, "o", rel_err(o, ro), tol_o), record(case, "final", rel_err(S, rS), tol_o)]
    results += [record(case, f"d{n}", rel_err(grads[n], r), tol_g) for n, r in rgrads.items()]
    check(results)


@pytest.mark.parametrize(
    "dtype, T, Hqk, Hv, K", [(BF16, 1000, 2, 4, 128), (BF16, 4097, 1, 4, 64), (FP32, 65, 2, 6, 64)]
)
def test_gva_triton(dtype, T, Hqk, Hv, K):
    inputs = make(2, T, Hqk, Hv, K, K, dtype=dtype, seed=T)
    fn = lambda q, k, v, g, b, h0: chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                             backend="triton")  # fmt: skip
    compare(f"GVA {Hqk}->{Hv} {dtype} T={T}", fn, inputs)


def test_beta_logits_triton_bf16():
    inputs = make(2, 1000, 4, 4, 128, 128, dtype=BF16, seed=3, logits=True)
    fn = lambda q, k, v, g, b, h0: chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                             use_beta_sigmoid=True, backend="triton")  # fmt: skip
    compare("beta logits bf16", fn, inputs, dict(logits=True))


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_chunk_states_triton(dtype, varlen):
    """bf16: the states are stored in the input dtype, so they hold to the bf16 output tolerance."""
    cu = torch.tensor([0, 1, 1, 1000, 4097], device="cuda") if varlen else None
    B, N = (1, 4) if varlen else (2, None)
    inputs = make(B, 4097, 2, 4, 128, 128, dtype=dtype, seed=5, N=N)
    with torch.no_grad():
        o, S, states = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, cu_seqlens=cu,
                                 backend="triton", return_chunk_states=True)  # fmt: skip
        ro, rS, rstates = reference(*inputs, cu_seqlens=cu, states=True)
    tol = TOL[dtype][0]
    assert states.shape == rstates.shape and states.dtype == torch.float32
    case = f"chunk states {dtype} {'varlen' if varlen else 'batch'}"
    check([record(case, "o", rel_err(o, ro), tol), record(case, "final", rel_err(S, rS), tol),
           record(case, "states", rel_err(states, rstates), tol)])  # fmt: skip


def test_auto_with_chunk_size_32_is_the_reference():
    inputs = make(2, 300, 1, 2, 64, 64, dtype=BF16, seed=7)
    kw = dict(initial_state=inputs[5], output_final_state=True, chunk_size=32)
    o, S = chunk_kda(*inputs[:5], **kw)
    ro, rS = chunk_kda(*inputs[:5], backend="torch", **kw)
    assert torch.equal(o, ro) and torch.equal(S, rS)


def _decode_inputs(B, Hqk, Hv, K, V, P, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).cuda()
    x = [rnd(B, 1, Hqk, K), rnd(B, 1, Hqk, K), rnd(B, 1, Hv, V), rnd(B, 1, Hv, K), rnd(B, 1, Hv)]
    gate = dict(gate="bounded", A_log=0.3 * rnd(Hv), dt_bias=0.1 * rnd(Hv * K), use_qk_l2norm=True,
                use_beta_sigmoid=True)  # fmt: skip
    return x, gate, rnd(P, Hv, K, V)  # float32: the reference path rounds l2-normalised q, k to the input dtype


def test_decode_pool_triton_against_torch():
    """B = 64 slots on a pool of 128 rows, every fourth a padding slot: the kernel path against the reference path,
    both from the same pool; unaddressed rows bit for bit."""
    B, P = 64, 128
    x, gate, pool = _decode_inputs(B, 8, 16, 128, 128, P, seed=9)
    idx = torch.randperm(P, generator=torch.Generator().manual_seed(10))[:B].cuda()
    idx[::4] = -1
    pools = {}
    outs = {}
    for backend in ("triton", "torch"):
        pools[backend] = pool.clone()
        outs[backend] = kda_decode_step(*x, pools[backend], state_indices=idx, backend=backend, **gate)
    untouched = torch.ones(P, dtype=torch.bool, device="cuda")
    untouched[idx[idx >= 0]] = False
    check([record("decode pool", "o", rel_err(outs["triton"], outs["torch"]), 1e-5),
           record("decode pool", "pool", rel_err(pools["triton"], pools["torch"]), 1e-5)])  # fmt: skip
    assert torch.equal(pools["triton"][untouched], pool[untouched])
    assert not outs["triton"][::4].any()


def test_decode_pool_in_a_cuda_graph():
    """The pooled step has no host sync: captured once, replayed with other indices, it equals eager calls."""
    B, P = 8, 32
    x, gate, pool = _decode_inputs(B, 2, 4, 64, 64, P, seed=11)
    idx = torch.arange(B, device="cuda")
    static_pool = pool.clone()
    kda_decode_step(*x, static_pool.clone(), state_indices=idx, backend="triton", **gate)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_decode_step(*x, static_pool, state_indices=idx, backend="triton", **gate)
    eager_pool = pool.clone()
    static_pool.copy_(pool)
    for step, new in enumerate(([5, -1, 7, 0, 31, -1, 2, 9], [-1] * B, [30, 29, 28, 27, -1, 1, 3, 4])):
        idx.copy_(torch.tensor(new))
        graph.replay()
        ref = kda_decode_step(*x, eager_pool, state_indices=idx, backend="triton", **gate)
        assert torch.equal(out, ref), f"replay {step}: outputs differ from the eager step"
        assert torch.equal(static_pool, eager_pool), f"replay {step}: pools differ from the eager step"


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla) not installed")
def test_fla_pass_through():
    """GVA and beta logits handed to FLA natively, and FLA's chunk states (inference only) at 64 and 32."""
    inputs = make(2, 1000, 2, 4, 128, 128, dtype=BF16, seed=13, logits=True)
    fn = lambda q, k, v, g, b, h0: chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                             use_beta_sigmoid=True, backend="fla")  # fmt: skip
    compare("FLA GVA + beta logits", fn, inputs, dict(logits=True))
    results = []
    for cs in (64, 32):
        with torch.no_grad():
            o, S, states = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=cs,
                                     use_beta_sigmoid=True, backend="fla", return_chunk_states=True)  # fmt: skip
            ro, rS, rstates = reference(*inputs, chunk_size=cs, logits=True, states=True)
        assert states.shape == rstates.shape
        results += [record(f"FLA chunk states C={cs}", "o", rel_err(o, ro), 1e-2),
                    record(f"FLA chunk states C={cs}", "states", rel_err(states, rstates), 1e-2)]  # fmt: skip
    check(results)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    with pytest.raises(ValueError, match="only when no gradient is needed"):
        chunk_kda(*leaves[:5], backend="fla", return_chunk_states=True)
