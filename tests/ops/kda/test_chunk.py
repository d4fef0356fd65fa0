"""KDA ops: chunkwise (torch) against the recurrent ground truth, the recurrence against the report's matrix form,
varlen, gradcheck, numerical safety of the gate range, causality, dtypes and input validation."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import chunk_kda, recurrent_kda, validate_kda_inputs
from hybrid_attention.ops.kda.common import sequence_bounds
from tests.helpers import assert_close

H, K, V = 2, 16, 8
NAMES = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(B, T, *, N=None, h=H, k_dim=K, v_dim=V, dtype=torch.float32, g_low=-5.0, h0=True):
    """Realistic KDA inputs: q, k unit vectors per head, g in (g_low, 0), beta in (0, 1), a random start state."""
    q = F.normalize(torch.randn(B, T, h, k_dim, dtype=torch.float64), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, h, k_dim, dtype=torch.float64), dim=-1).to(dtype)
    v = torch.randn(B, T, h, v_dim, dtype=dtype)
    g = (g_low * torch.rand(B, T, h, k_dim, dtype=torch.float64)).to(dtype)
    beta = torch.rand(B, T, h, dtype=torch.float64).to(dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.randn(B if N is None else N, h, k_dim, v_dim, dtype=state_dtype) if h0 else None
    return [q, k, v, g, beta, s0]


def run_with_grads(fn, inputs, do, dS, **kwargs):
    """Run `fn` on leaf copies of `inputs`; return (o, S, grads of every non-None input) for loss o.do + S.dS."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, s0 = leaves
    o, S = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kwargs)
    loss = (o.double() * do).sum() + (S.double() * dS).sum()
    names = [n for n, x in zip(NAMES, leaves, strict=True) if x is not None]
    grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
    return o, S, dict(zip(names, grads, strict=True))


def compare_to_recurrent(inputs, tol, cu_seqlens=None, scale=None, chunk_size=64):
    """chunk_kda(backend="torch") against recurrent_kda: outputs, final states and every gradient."""
    q, v = inputs[0], inputs[2]
    N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    do = torch.randn(v.shape, dtype=torch.float64)
    dS = torch.randn(N, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
    common = dict(cu_seqlens=cu_seqlens, scale=scale)
    ref_o, ref_S, ref_grads = run_with_grads(recurrent_kda, inputs, do, dS, **common)
    o, S, grads = run_with_grads(chunk_kda, inputs, do, dS, **common, chunk_size=chunk_size, backend="torch")
    assert_close("o", o, ref_o, tol)
    assert_close("final state", S, ref_S, tol)
    for name, ref in ref_grads.items():
        assert_close(f"d{name}", grads[name], ref, tol)
    return o, S, grads


@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 15, 64, 100, 257])
def test_chunk_matches_recurrent(T, chunk_size, with_h0):
    torch.manual_seed(T * 7 + chunk_size + with_h0)
    compare_to_recurrent(make_inputs(2, T, h0=with_h0), 1e-5, chunk_size=chunk_size)


def test_chunk_matches_recurrent_chunk32_and_scale():
    torch.manual_seed(1)
    compare_to_recurrent(make_inputs(2, 100), 1e-5, chunk_size=32, scale=0.3)


def test_default_scale_and_no_final_state():
    torch.manual_seed(2)
    q, k, v, g, beta, s0 = make_inputs(1, 20)
    for fn in (recurrent_kda, lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)):
        o_default, none_state = fn(q, k, v, g, beta, initial_state=s0)
        o_explicit, _ = fn(q, k, v, g, beta, initial_state=s0, scale=K**-0.5)
        o_other, _ = fn(q, k, v, g, beta, initial_state=s0, scale=1.0)
        assert none_state is None
        assert_close("default scale", o_default, o_explicit, 1e-7)
        assert (o_other - o_default).abs().max() > 1e-3  # the scale is actually used


def report_matrix_form(q, k, v, g, beta, s0, scale):
    """float64 S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = scale S_t^T q_t, with explicit matrices."""
    B, T, Hh, Kk = q.shape
    o = torch.zeros(B, T, Hh, v.shape[-1], dtype=torch.float64)
    S_out = torch.zeros_like(s0)
    eye = torch.eye(Kk, dtype=torch.float64)
    for b in range(B):
        for h in range(Hh):
            S = s0[b, h].clone()
            for t in range(T):
                kt = k[b, t, h].unsqueeze(1)  # [K, 1]
                transition = (eye - beta[b, t, h] * kt @ kt.T) @ torch.diag(g[b, t, h].exp())
                S = transition @ S + beta[b, t, h] * kt @ v[b, t, h].unsqueeze(0)
                o[b, t, h] = scale * S.T @ q[b, t, h]
            S_out[b, h] = S
    return o, S_out


def test_recurrent_matches_report_matrix_form():
    torch.manual_seed(3)
    q, k, v, g, beta, s0 = make_inputs(2, 23, h=2, k_dim=6, v_dim=5, dtype=torch.float64)
    o, S = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, scale=0.7)
    ref_o, ref_S = report_matrix_form(q, k, v, g, beta, s0, 0.7)
    assert_close("o", o, ref_o, 1e-12)
    assert_close("S", S, ref_S, 1e-12)


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_varlen_equals_per_sequence(op):
    torch.manual_seed(4)
    cu = torch.tensor([0, 5, 70, 71, 200], dtype=torch.int32)
    inputs = make_inputs(1, 200, N=4)
    do = torch.randn(inputs[2].shape, dtype=torch.float64)
    dS = torch.randn(4, H, K, V, dtype=torch.float64)
    fn = recurrent_kda if op == "recurrent" else lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)
    o, S, grads = run_with_grads(fn, inputs, do, dS, cu_seqlens=cu)
    for n, (s, e) in enumerate(sequence_bounds(cu)):
        piece = [x[:, s:e] for x in inputs[:5]] + [inputs[5][n : n + 1]]
        o_n, S_n, grads_n = run_with_grads(fn, piece, do[:, s:e], dS[n : n + 1])
        assert_close(f"o[{n}]", o[:, s:e], o_n, 1e-6)
        assert_close(f"S[{n}]", S[n : n + 1], S_n, 1e-6)
        for name in ("q", "k", "v", "g", "beta"):
            assert_close(f"d{name}[{n}]", grads[name][:, s:e], grads_n[name], 1e-6)
        assert_close(f"dh0[{n}]", grads["h0"][n : n + 1], grads_n["h0"], 1e-6)


def test_varlen_chunk_matches_varlen_recurrent():
    torch.manual_seed(5)
    cu = torch.tensor([0, 5, 70, 71, 200], dtype=torch.int64)
    compare_to_recurrent(make_inputs(1, 200, N=4), 1e-5, cu_seqlens=cu, chunk_size=64)


def test_varlen_empty_sequence_keeps_its_state():
    torch.manual_seed(6)
    cu = torch.tensor([0, 3, 3, 10])
    q, k, v, g, beta, s0 = make_inputs(1, 10, N=3)
    for fn in (recurrent_kda, lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)):
        o, S = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        assert o.shape == v.shape
        assert torch.equal(S[1], s0[1])
        o_last, S_last = fn(*(x[:, 3:] for x in (q, k, v, g, beta)), initial_state=s0[2:], output_final_state=True)
        assert_close("o of the third sequence", o[:, 3:], o_last, 1e-6)
        assert_close("S of the third sequence", S[2:], S_last, 1e-6)


def test_gradcheck_recurrent():
    torch.manual_seed(7)
    inputs = [x.requires_grad_() for x in make_inputs(1, 6, h=1, k_dim=4, v_dim=3, dtype=torch.float64)]
    fn = lambda q, k, v, g, b, s0: recurrent_kda(q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("T", [5, 19])
def test_gradcheck_chunk(T):
    """T = 5 is one padded chunk; T = 19 is a full chunk of 16 and a padded one, with an initial state."""
    torch.manual_seed(8 + T)
    inputs = [x.requires_grad_() for x in make_inputs(1, T, h=1, k_dim=4, v_dim=3, dtype=torch.float64)]
    fn = lambda q, k, v, g, b, s0: chunk_kda(
        q, k, v, g, b, initial_state=s0, output_final_state=True, chunk_size=16, backend="torch"
    )
    assert torch.autograd.gradcheck(fn, inputs)


def gate_case(kind: str, T: int) -> torch.Tensor:
    if kind == "uniform":
        return -5.0 * torch.rand(1, T, H, K)
    if kind == "at_bound":
        return torch.full((1, T, H, K), -5.0 + 1e-6)
    g = -5.0 * torch.rand(1, T, H, K)  # "-1000": whole tokens and single channels that erase the state
    g[:, torch.rand(T) < 0.05] = -1000.0
    g[torch.rand(1, T, H, K) < 0.05] = -1000.0
    return g


@pytest.mark.parametrize("kind", ["uniform", "at_bound", "minus_1000"])
def test_safe_for_the_whole_gate_range(kind):
    torch.manual_seed(9)
    inputs = make_inputs(1, 1024)
    inputs[3] = gate_case(kind, 1024)
    o, S, grads = compare_to_recurrent(inputs, 1e-5, chunk_size=64)
    for name, t in [("o", o), ("S", S), *grads.items()]:
        assert torch.isfinite(t).all(), f"{name} has inf/NaN"


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_causality(op):
    torch.manual_seed(10)
    fn = recurrent_kda if op == "recurrent" else lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)
    T, t = 40, 20  # t sits inside the second chunk of 16, so the perturbed tokens share its chunk
    inputs = make_inputs(2, T)
    o, _ = fn(*inputs[:5], initial_state=inputs[5])
    perturbed = [x.clone() for x in inputs[:5]]
    perturbed[0][:, t + 1 :] = F.normalize(torch.randn_like(perturbed[0][:, t + 1 :]), dim=-1)
    perturbed[1][:, t + 1 :] = F.normalize(torch.randn_like(perturbed[1][:, t + 1 :]), dim=-1)
    perturbed[2][:, t + 1 :] *= 3.0
    perturbed[3][:, t + 1 :] = -1000.0
    perturbed[4][:, t + 1 :] = 0.5
    o2, _ = fn(*perturbed, initial_state=inputs[5])
    assert torch.equal(o[:, : t + 1], o2[:, : t + 1])
    assert not torch.allclose(o[:, t + 1 :], o2[:, t + 1 :])

    leaves = [x.clone().requires_grad_() for x in inputs[:5]]
    o3, _ = fn(*leaves, initial_state=inputs[5])
    grads = torch.autograd.grad(o3[:, : t + 1].sum(), leaves)
    for name, grad in zip(NAMES, grads, strict=False):  # no h0 here
        assert torch.count_nonzero(grad[:, t + 1 :]) == 0, f"d{name} leaks from the future"
        assert torch.count_nonzero(grad[:, : t + 1]) > 0


POISONS = [
    ("q", "nan"),
    ("q", "inf"),
    ("k", "nan"),
    ("k", "inf"),
    ("v", "nan"),
    ("v", "inf"),
    ("g", "nan"),
    ("beta", "nan"),
]  # an infinite g > 0 or beta > 1 is refused by the input checks


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
@pytest.mark.parametrize("name, value", POISONS)
def test_poisoned_future_leaves_the_past_bit_identical(op, name, value):
    """A NaN or inf in one input at token t (inside a chunk, so later rows of that chunk see it too): every output
    before t is bit-identical to the clean run; outputs from t on are not finite (only o_t for q), as the recurrence
    gives. A padded batch whose padding holds garbage therefore cannot reach its real tokens."""
    torch.manual_seed(11)
    fn = recurrent_kda if op == "recurrent" else lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)
    t = 21
    inputs = make_inputs(2, 40)
    o, _ = fn(*inputs[:5], initial_state=inputs[5])
    poisoned = [x.clone() for x in inputs[:5]]
    poisoned[NAMES.index(name)][1, t] = float(value)
    o2, S2 = fn(*poisoned, initial_state=inputs[5], output_final_state=True)
    assert torch.equal(o2[:, :t], o[:, :t]) and torch.equal(o2[0], o[0])  # the past, and the other sequence
    assert not torch.isfinite(o2[1, t]).all()
    if name != "q":
        assert not torch.isfinite(o2[1, t:].sum(-1)).any() and not torch.isfinite(S2[1]).all()


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_values_outside_the_math_raise(op):
    """g > 0, beta outside [0, 1] and a scale that is NaN, infinite or <= 0 raise with a message that says so."""
    fn = recurrent_kda if op == "recurrent" else lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)
    inputs = make_inputs(1, 20, h0=False)
    for index, value, match in ((3, 0.25, "g is a log decay"), (4, 1.5, "beta must lie"), (4, -0.5, "beta must")):
        bad = [x.clone() for x in inputs[:5]]
        bad[index][0, 7] = value
        with pytest.raises(ValueError, match=match):
            fn(*bad)
    for scale in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            fn(*inputs[:5], scale=scale)


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_minus_infinite_decay_resets_the_state(op):
    """g = -inf at token t: exp(g) = 0 erases the state, exactly; the chunked form agrees and stays finite."""
    torch.manual_seed(12)
    fn = recurrent_kda if op == "recurrent" else lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)
    inputs = make_inputs(1, 40)
    inputs[3][:, 21] = float("-inf")
    inputs[3][:, 30, :, 1] = float("-inf")
    o, S = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    ref_o, ref_S = recurrent_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close("o", o, ref_o, 1e-5)
    assert_close("final state", S, ref_S, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dtype_contract(dtype):
    torch.manual_seed(11)
    q, k, v, g, beta, s0 = make_inputs(1, 33, dtype=dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    g32 = g.float() if dtype != torch.float64 else g
    for fn in (recurrent_kda, lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)):
        o, S = fn(q, k, v, g32, beta, initial_state=s0, output_final_state=True)
        assert o.dtype == dtype and S.dtype == state_dtype
        o0, S0 = fn(q, k, v, g, beta, output_final_state=True)  # no initial state: zeros in the state dtype
        assert o0.dtype == dtype and S0.dtype == state_dtype
    if dtype == torch.bfloat16:  # bf16 inputs are computed in float32: compare with float32 math on the same values
        o, S = chunk_kda(q, k, v, g32, beta, initial_state=s0, output_final_state=True, backend="torch")
        ref_o, ref_S = recurrent_kda(
            *(x.float() for x in (q, k, v, g, beta)), initial_state=s0, output_final_state=True
        )
        assert_close("bf16 o", o, ref_o, 1e-2)
        assert_close("bf16 S", S, ref_S, 1e-5)


def test_autocast_does_not_lower_the_reference_precision():
    torch.manual_seed(13)
    q, k, v, g, beta, s0 = make_inputs(1, 40)
    for fn in (recurrent_kda, lambda *a, **kw: chunk_kda(*a, backend="torch", chunk_size=16, **kw)):
        ref_o, ref_S = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o, S = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert o.dtype == torch.float32
        assert_close("o under autocast", o, ref_o, 1e-6)
        assert_close("S under autocast", S, ref_S, 1e-6)


def test_auto_backend_is_the_torch_reference():
    torch.manual_seed(12)
    q, k, v, g, beta, s0 = make_inputs(2, 30)
    o1, S1 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, S2 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, backend="torch")
    assert torch.equal(o1, o2) and torch.equal(S1, S2)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: every case raises ValueError naming the problem.


def _valid():
    q, k, v, g, beta, s0 = make_inputs(2, 10)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, cu_seqlens=None)


def _packed():
    d = _valid()
    for name in ("q", "k", "v", "g", "beta"):
        d[name] = d[name][:1]
    d["initial_state"] = d["initial_state"][:1].repeat(3, 1, 1, 1)
    d["cu_seqlens"] = torch.tensor([0, 4, 4, 10])
    return d


BAD_CASES = {
    "q rank": (lambda d: d.update(q=d["q"][0]), "q must be"),
    "q not a tensor": (lambda d: d.update(q=d["q"].tolist()), "q must be a torch.Tensor"),
    "state not a tensor": (lambda d: d.update(initial_state=d["initial_state"].tolist()), "initial_state must be a"),
    "k shape": (lambda d: d.update(k=d["k"][:, :, :, :8]), "k must have the shape"),
    "v heads": (lambda d: d.update(v=d["v"][:, :, :1]), "v must be"),
    "g shape": (lambda d: d.update(g=d["g"][:, :5]), "g must have the shape"),
    "beta shape": (lambda d: d.update(beta=d["beta"].unsqueeze(-1)), "beta must be"),
    "empty T": (lambda d: d.update(**{n: d[n][:, :0] for n in ("q", "k", "v", "g", "beta")}), "T, H, K >= 1"),
    "int q": (lambda d: d.update(**{n: d[n].long() for n in ("q", "k", "v")}), "q must be float16"),
    "v dtype": (lambda d: d.update(v=d["v"].double()), "share one dtype"),
    "g dtype": (lambda d: d.update(g=d["g"].double()), "g must be"),
    "beta dtype": (lambda d: d.update(**{n: d[n].half() for n in ("q", "k", "v")}, beta=d["beta"].bfloat16()), "beta"),
    "state shape": (lambda d: d.update(initial_state=d["initial_state"][:1]), "initial_state must be"),
    "state bf16": (lambda d: d.update(initial_state=d["initial_state"].bfloat16()), "initial_state must be"),
    "state f64 for f32": (lambda d: d.update(initial_state=d["initial_state"].double()), "initial_state must be"),
    "cu float": (lambda d: d.update(_packed(), cu_seqlens=torch.tensor([0.0, 4.0, 4.0, 10.0])), "int32 or int64"),
    "cu 2-D": (lambda d: d.update(_packed(), cu_seqlens=torch.tensor([[0, 4, 4, 10]])), "1-D"),
    "cu start": (lambda d: d.update(_packed(), cu_seqlens=torch.tensor([1, 4, 4, 10])), "start at 0"),
    "cu end": (lambda d: d.update(_packed(), cu_seqlens=torch.tensor([0, 4, 4, 9])), "end at T"),
    "cu decreasing": (lambda d: d.update(_packed(), cu_seqlens=torch.tensor([0, 6, 4, 10])), "non-decreasing"),
    "cu with B=2": (lambda d: d.update(cu_seqlens=torch.tensor([0, 4, 10])), "B == 1"),
    "cu state rows": (lambda d: d.update(_packed(), initial_state=d["initial_state"][:2]), "N = len(cu_seqlens)"),
}


@pytest.mark.parametrize("fn_name", ["recurrent", "chunk", "validate"])
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises(case, fn_name):
    mutate, message = BAD_CASES[case]
    d = _valid()
    mutate(d)
    with pytest.raises(ValueError, match=re.escape(message)):
        if fn_name == "validate":
            validate_kda_inputs(
                d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"], d["cu_seqlens"], name="test"
            )
        else:
            fn = recurrent_kda if fn_name == "recurrent" else lambda *a, **kw: chunk_kda(*a, backend="torch", **kw)
            fn(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"])


def test_packed_valid_case_passes():
    d = _packed()
    assert (
        validate_kda_inputs(d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"], d["cu_seqlens"], name="t")
        == 3
    )


@pytest.mark.parametrize("chunk_size", [8, 48, 128, 64.0, True])
def test_bad_chunk_size(chunk_size):
    q, k, v, g, beta, _ = make_inputs(1, 10)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, backend="torch")


def test_unknown_backend():
    q, k, v, g, beta, _ = make_inputs(1, 10)
    with pytest.raises(ValueError, match="unknown backend 'cuda'.*auto, torch, triton, fla"):
        chunk_kda(q, k, v, g, beta, backend="cuda")


def test_fla_backend_missing_package(monkeypatch):
    for module in ("fla", "fla.ops", "fla.ops.kda"):  # make `import fla...` fail even where fla is installed
        monkeypatch.setitem(sys.modules, module, None)
    q, k, v, g, beta, _ = make_inputs(1, 10)
    with pytest.raises(ValueError, match=r"pip install \"hybrid-attention\[fla\]\""):
        chunk_kda(q, k, v, g, beta, backend="fla")


def test_fla_backend_rejects_chunk_16():
    q, k, v, g, beta, _ = make_inputs(1, 10)
    with pytest.raises(ValueError, match="chunk_size must be one of \\(32, 64\\)"):
        chunk_kda(q, k, v, g, beta, backend="fla", chunk_size=16)


def test_triton_backend_missing_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "hybrid_attention.ops.kda.triton_chunk", None)
    q, k, v, g, beta, _ = make_inputs(1, 10)
    with pytest.raises(ValueError, match='backend="triton" is unavailable'):
        chunk_kda(q, k, v, g, beta, backend="triton")


@pytest.mark.parametrize("form, lower_bound", [("bounded", -4.0), ("bounded", -12.0), ("softplus", None)])
def test_dispatch_fused_gate_and_l2norm_match_explicit(form, lower_bound):
    """chunk_kda(raw z, gate=form, ..., use_qk_l2norm) == chunk_kda on kda_gate(z) and normalised q, k."""
    from hybrid_attention.ops.kda import chunk_kda, kda_gate, l2_normalize

    torch.manual_seed(0)
    B, T, H, K, V = 1, 37, 2, 16, 8
    q, k, z = (torch.randn(B, T, H, K) for _ in range(3))
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    A_log, dt_bias = 0.3 * torch.randn(H), torch.randn(H * K)
    fused, _ = chunk_kda(q, k, v, z, beta, gate=form, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                         use_qk_l2norm=True, backend="torch")  # fmt: skip
    g = kda_gate(z, A_log, dt_bias, lower_bound, form=form)
    explicit, _ = recurrent_kda(l2_normalize(q), l2_normalize(k), v, g, beta)
    assert_close("fused gate + l2norm", fused, explicit, 1e-5)


def test_gate_flag_is_explicit():
    """g is the decay unless `gate` names a form; gate parameters without the flag, or a flag without them, raise."""
    from hybrid_attention.ops.kda import chunk_kda

    B, T, H, K, V = 1, 5, 2, 4, 4
    q, k, z = (torch.randn(B, T, H, K) for _ in range(3))
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    with pytest.raises(ValueError, match="pass gate="):
        chunk_kda(q, k, v, z, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, backend="torch")
    with pytest.raises(ValueError, match="needs A_log and dt_bias"):
        chunk_kda(q, k, v, z, beta, gate="bounded", A_log=A_log, backend="torch")
    with pytest.raises(ValueError, match="gate must be one of"):
        chunk_kda(q, k, v, z, beta, gate="head", A_log=A_log, dt_bias=dt_bias, backend="torch")
    with pytest.raises(ValueError, match='"bounded" gate only'):
        chunk_kda(q, k, v, z, beta, gate="softplus", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, backend="torch")
    with pytest.raises(ValueError, match="lower_bound must be a finite number < 0"):
        chunk_kda(q, k, v, z, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=0.0, backend="torch")
    # The bounded gate's default lower bound is -5.
    a, _ = chunk_kda(q, k, v, z, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias, backend="torch")
    b, _ = chunk_kda(q, k, v, z, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, backend="torch")
    assert torch.equal(a, b)


def test_auto_backend_is_torch_on_cpu():
    from hybrid_attention.ops.kda import resolve_backend

    assert resolve_backend("auto", torch.zeros(1)) == "torch"
    assert resolve_backend("triton", torch.zeros(1)) == "triton"
