"""KDA op features: more value heads than query/key heads (GVA), chunk_size 32 under "auto", the per-chunk states,
decoding with a pool of states addressed by indices, and beta given as logits.

Every result is held against a definition that does not share the feature's code path: GVA against one
`recurrent_kda` call per value head on slices of the shared q and k (autograd sums their gradients), the chunk
states against `recurrent_kda` run up to each chunk boundary, the pool against one reference call per sequence on
its own state. The PyTorch reference runs in float64 (tolerance 1e-12); the Triton kernels in float32 under the
interpreter at tiny shapes (1e-5, as tests/ops/kda/test_triton.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import chunk_kda, kda_decode_step, kda_gate, l2_normalize, recurrent_kda, resolve_backend
from hybrid_attention.ops.kda.naive import naive_recurrent_kda as recurrent_per_head
from tests.helpers import DEV, assert_close, needs_triton

TOL64 = 1e-12
TOL32 = 1e-5
NAMES = ("q", "k", "v", "g", "beta", "h0")


def make(B, T, Hqk, Hv, K, V, *, seed, N=None, dtype=torch.float64, logits=False, device="cpu"):
    """q, k unit vectors [B, T, Hqk, K]; v [B, T, Hv, V]; g in (-5, 0); beta in (0, 1) (or logits in about
    (-6, 6)); a random start state [N or B, Hv, K, V] (float32 unless float64 inputs). Drawn in float64."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = F.normalize(rnd(B, T, Hqk, K), dim=-1), F.normalize(rnd(B, T, Hqk, K), dim=-1)
    g = -5 * torch.rand(B, T, Hv, K, generator=gen, dtype=torch.float64)
    beta = 3 * rnd(B, T, Hv) if logits else torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    h0 = rnd(N or B, Hv, K, V)
    x = [t.to(dtype).to(device) for t in (q, k, rnd(B, T, Hv, V), g, beta)]
    return x + [h0.to(torch.float64 if dtype == torch.float64 else torch.float32).to(device)]


def per_value_head(q, k, v, g, beta, h0, *, cu_seqlens=None, beta_logits=False):
    """The GVA definition: value head j is ordinary KDA on query/key head j // (Hv // Hqk), one reference call per
    value head on slices of the shared q and k."""
    G = v.shape[2] // q.shape[2]
    if beta_logits:
        beta = torch.sigmoid(beta)
    outs, states = [], []
    for j in range(v.shape[2]):
        i = j // G
        o, S = recurrent_per_head(
            q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, j : j + 1], g[:, :, j : j + 1], beta[:, :, j : j + 1],
            initial_state=h0[:, j : j + 1], output_final_state=True, cu_seqlens=cu_seqlens,
        )  # fmt: skip
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=2), torch.cat(states, dim=1)


def outputs_and_grads(fn, inputs, seed=100):
    """(o, S, {name: gradient}) for loss = <o, dO> + <S, dS> with fixed random dO, dS."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves)[:2]
    gen = torch.Generator().manual_seed(seed)
    dO = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(o.device)
    loss = (o.double() * dO).sum() + (S.double() * dS).sum()
    grads = torch.autograd.grad(loss, leaves)
    return o, S, dict(zip(NAMES, grads, strict=True))


def compare(fn, ref, inputs, tol, ref_inputs=None):
    o, S, grads = outputs_and_grads(fn, inputs)
    ro, rS, rgrads = outputs_and_grads(ref, inputs if ref_inputs is None else ref_inputs)
    assert_close("o", o, ro, tol)
    assert_close("final state", S, rS, tol)
    for name, r in rgrads.items():
        assert_close(f"d{name}", grads[name], r, tol)


# ---------------------------------------------------------------------------------------------------------------
# More value heads than query/key heads.


@pytest.mark.parametrize("Hqk, Hv", [(1, 3), (2, 4)])
def test_gva_recurrent_matches_one_call_per_value_head(Hqk, Hv):
    inputs = make(2, 13, Hqk, Hv, 8, 6, seed=Hv)
    fn = lambda q, k, v, g, beta, h0: recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    compare(fn, per_value_head, inputs, TOL64)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_gva_chunk_torch_matches_definition(chunk_size):
    inputs = make(2, 45, 2, 4, 8, 6, seed=chunk_size)
    fn = lambda q, k, v, g, beta, h0: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 chunk_size=chunk_size, backend="torch")  # fmt: skip
    compare(fn, per_value_head, inputs, TOL64)


def test_gva_varlen_torch():
    cu = torch.tensor([0, 7, 7, 40])
    inputs = make(1, 40, 1, 2, 8, 8, N=3, seed=3)
    fn = lambda q, k, v, g, beta, h0: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 cu_seqlens=cu, chunk_size=16, backend="torch")  # fmt: skip
    ref = lambda *x: per_value_head(*x, cu_seqlens=cu)
    compare(fn, ref, inputs, TOL64)


@needs_triton
def test_gva_and_beta_logits_triton():
    """Our kernels with two value heads on one query/key head and beta as logits: float32 against the float64
    definition, outputs and every gradient (the shared q, k gradients summed over the group)."""
    inputs = make(1, 70, 1, 2, 16, 16, seed=5, dtype=torch.float32, logits=True, device=DEV)
    fn = lambda q, k, v, g, beta, h0: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 use_beta_sigmoid=True, backend="triton")  # fmt: skip
    ref = lambda *x: per_value_head(*x, beta_logits=True)
    compare(fn, ref, inputs, TOL32, ref_inputs=[x.double() for x in inputs])


def test_gva_gate_has_value_heads():
    """The gate's A_log and dt_bias are per value head: [Hv] and [Hv * K]."""
    q, k, v, z, beta, h0 = make(1, 9, 1, 2, 8, 8, seed=6)
    gen = torch.Generator().manual_seed(60)
    A_log, dt_bias = (
        torch.randn(2, generator=gen, dtype=torch.float64),
        torch.randn(16, generator=gen, dtype=torch.float64),
    )
    o, S = chunk_kda(q, k, v, z, beta, initial_state=h0, output_final_state=True, gate="softplus", A_log=A_log,
                     dt_bias=dt_bias, backend="torch")  # fmt: skip
    ro, rS = per_value_head(q, k, v, kda_gate(z, A_log, dt_bias, form="softplus"), beta, h0)
    assert_close("o", o, ro, TOL64)
    assert_close("S", S, rS, TOL64)
    with pytest.raises(ValueError, match="A_log must be"):
        chunk_kda(q, k, v, z, beta, gate="softplus", A_log=A_log[:1], dt_bias=dt_bias, backend="torch")


@pytest.mark.parametrize("fn", [recurrent_kda, lambda *x: chunk_kda(*x, backend="torch")], ids=["recurrent", "chunk"])
def test_gva_head_count_must_divide(fn):
    q, k, v, g, beta, _ = make(1, 5, 2, 3, 8, 8, seed=7)
    with pytest.raises(ValueError, match="whole multiple of the 2 heads of q and k"):
        fn(q, k, v, g, beta)


# ---------------------------------------------------------------------------------------------------------------
# Chunk size 32.


def test_auto_sends_chunk_size_32_to_the_reference(monkeypatch):
    """On a GPU, "auto" runs our kernels at chunk size 64 only; 32 goes to the PyTorch reference, which takes it."""
    import hybrid_attention.ops.kda.chunk as kda

    q = torch.zeros(1, 4, 1, 8)
    monkeypatch.setattr(kda, "use_triton", lambda x: True)  # as if q were a CUDA tensor
    assert resolve_backend("auto", q, 64) == "triton"
    assert resolve_backend("auto", q, 32) == "torch"
    monkeypatch.undo()
    inputs = make(2, 41, 1, 1, 8, 8, seed=8)
    fn = lambda q, k, v, g, beta, h0: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 chunk_size=32)  # fmt: skip
    ref = lambda q, k, v, g, beta, h0: recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    compare(fn, ref, inputs, TOL64)


def test_triton_refuses_chunk_size_32_clearly():
    q, k, v, g, beta, _ = make(1, 8, 1, 1, 16, 16, seed=9, dtype=torch.float32)
    with pytest.raises(ValueError, match="runs chunks of 64 tokens only"):
        chunk_kda(q, k, v, g, beta, chunk_size=32, backend="triton")


# ---------------------------------------------------------------------------------------------------------------
# Per-chunk states.


def states_by_recurrence(q, k, v, g, beta, h0, chunk_size, cu_seqlens=None):
    """The state before token j * chunk_size of every sequence, each from `recurrent_kda` run up to there."""
    if cu_seqlens is None:
        bounds = [(0, q.shape[1])] * q.shape[0]
    else:
        bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    per_seq = []
    for n, (s, e) in enumerate(bounds):
        b = n if cu_seqlens is None else 0
        rows = []
        for t in range(s, e, chunk_size):
            if t == s:
                rows.append(h0[n])
                continue
            x = [y[b : b + 1, s:t] for y in (q, k, v, g, beta)]
            rows.append(recurrent_kda(*x, initial_state=h0[n : n + 1], output_final_state=True)[1][0])
        per_seq.append(rows)
    if cu_seqlens is None:
        return torch.stack([torch.stack(rows) for rows in per_seq])  # [B, NT, H, K, V]
    return torch.stack([r for rows in per_seq for r in rows]).unsqueeze(0)  # [1, NT_total, H, K, V]


@pytest.mark.parametrize("chunk_size, T", [(16, 37), (32, 64), (16, 5)])
def test_chunk_states_torch(chunk_size, T):
    q, k, v, g, beta, h0 = make(2, T, 1, 2, 8, 8, seed=T)
    o, S, states = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size,
                             backend="torch", return_chunk_states=True)  # fmt: skip
    ro, rS = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert states.shape == (2, -(-T // chunk_size), 2, 8, 8) and states.dtype == torch.float64
    assert_close("o", o, ro, TOL64)
    assert_close("final state", S, rS, TOL64)
    assert_close("chunk states", states, states_by_recurrence(q, k, v, g, beta, h0, chunk_size), TOL64)


def test_chunk_states_torch_varlen_with_empty_sequence():
    cu = [0, 20, 20, 21, 53]
    q, k, v, g, beta, h0 = make(1, 53, 1, 1, 8, 8, N=4, seed=11)
    o, S, states = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor(cu),
                             chunk_size=16, backend="torch", return_chunk_states=True)  # fmt: skip
    assert states.shape == (1, 2 + 0 + 1 + 2, 1, 8, 8)
    assert_close("chunk states", states, states_by_recurrence(q, k, v, g, beta, h0, 16, cu), TOL64)


def test_chunk_states_carry_no_gradient_and_outputs_keep_theirs():
    inputs = make(1, 20, 1, 1, 8, 8, seed=12)
    with_states = lambda *x: chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, chunk_size=16,
                                       backend="torch", return_chunk_states=True)  # fmt: skip
    plain = lambda *x: chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, chunk_size=16, backend="torch")
    compare(with_states, plain, inputs, TOL64)
    leaves = [x.clone().requires_grad_() for x in inputs]
    assert not with_states(*leaves)[2].requires_grad


@needs_triton
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_chunk_states_triton(varlen):
    """The states the forward stores for its backward, returned: against the recurrence up to each boundary."""
    cu = [0, 5, 5, 70, 90] if varlen else None
    B, T = (1, 90) if varlen else (2, 70)
    inputs = make(B, T, 1, 1, 16, 16, N=4 if varlen else None, seed=13, dtype=torch.float32, device=DEV)
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    with torch.no_grad():
        o, S, states = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, cu_seqlens=cu_t,
                                 backend="triton", return_chunk_states=True)  # fmt: skip
    ref = [x.double() for x in inputs]
    ro, rS = recurrent_kda(*ref[:5], initial_state=ref[5], output_final_state=True, cu_seqlens=cu_t)
    assert states.dtype == torch.float32 and states.shape == ((1, 1 + 0 + 2 + 1) if varlen else (2, 2)) + (1, 16, 16)
    assert_close("o", o, ro, TOL32)
    assert_close("final state", S, rS, TOL32)
    assert_close("chunk states", states, states_by_recurrence(*ref, 64, cu), TOL32)


# ---------------------------------------------------------------------------------------------------------------
# Decoding with a pool of states.


def decode_reference(q, k, v, z, beta_logits, pool, idx, A_log, dt_bias):
    """Per sequence: the float64 recurrence from its own pool row, with the bounded gate, l2norm and beta logits.
    Returns (outputs [B, T, Hv, V], {row: new state})."""
    G = v.shape[2] // q.shape[2]
    outs, rows = [], {}
    for b, r in enumerate(idx):
        if r < 0:
            outs.append(torch.zeros_like(v[b : b + 1], dtype=torch.float64))
            continue
        x = [t[b : b + 1].double() for t in (q, k, v, z, beta_logits)]
        qq, kk = (l2_normalize(t).repeat_interleave(G, dim=2) for t in x[:2])
        g = kda_gate(x[3], A_log.double(), dt_bias.double())
        o, S = recurrent_kda(qq, kk, x[2], g, torch.sigmoid(x[4]), initial_state=pool[r : r + 1].double(),
                             output_final_state=True)  # fmt: skip
        outs.append(o)
        rows[r] = S[0]
    return torch.cat(outs), rows


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize(
    "idx", [[3, -1, 0, 5], [-1, -1, -1, -1], [-1, 4, -1, 1]], ids=["mixed", "all-padding", "pad-first"]
)
def test_decode_with_state_pool(backend, idx):
    """Rows addressed by valid slots advance as each sequence alone would; every other row stays bit for bit;
    padding slots (their inputs NaN) give zeros."""
    B, T, Hqk, Hv, K, V, P = 4, 2, 1, 2, 16, 16, 6
    gen = torch.Generator().manual_seed(14)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEV)
    q, k, v, z, b = rnd(B, T, Hqk, K), rnd(B, T, Hqk, K), rnd(B, T, Hv, V), rnd(B, T, Hv, K), rnd(B, T, Hv)
    A_log, dt_bias = 0.3 * rnd(Hv), 0.1 * rnd(Hv * K)
    for b_pad in [b_ for b_, r in enumerate(idx) if r < 0]:
        for t in (q, k, v, z, b):
            t[b_pad] = float("nan")
    pool = rnd(P, Hv, K, V)
    before = pool.clone()
    flags = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True, use_beta_sigmoid=True)
    o = kda_decode_step(q, k, v, z, b, pool, state_indices=torch.tensor(idx, device=DEV), backend=backend, **flags)
    ro, rows = decode_reference(q, k, v, z, b, before, idx, A_log, dt_bias)
    assert o.shape == (B, T, Hv, V)
    assert_close("o", o, ro, TOL32)
    for r in range(P):
        if r in rows:
            assert_close(f"pool row {r}", pool[r], rows[r], TOL32)
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} was not addressed but changed"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_decode_without_pool_updates_in_place(backend):
    """state_indices=None: state [B, Hv, K, V] is the batch's own, updated in place; GVA and a decay g."""
    q, k, v, g, beta, h0 = make(3, 1, 1, 2, 16, 16, seed=15, dtype=torch.float32, device=DEV)
    state = h0.clone()
    o = kda_decode_step(q, k, v, g, beta, state, backend=backend)
    ref = [x.double() for x in (q, k, v, g, beta, h0)]
    ro, rS = per_value_head(*ref)
    assert_close("o", o, ro, TOL32)
    assert_close("state", state, rS, TOL32)


def test_decode_bad_indices():
    q, k, v, g, beta, h0 = make(2, 1, 1, 1, 8, 8, seed=16, dtype=torch.float32)
    pool = torch.zeros(4, 1, 8, 8)
    with pytest.raises(ValueError, match="int32 or int64"):
        kda_decode_step(q, k, v, g, beta, pool, state_indices=torch.tensor([0.0, 1.0]), backend="torch")
    with pytest.raises(ValueError, match=r"must be \[B\] = \[2\]"):
        kda_decode_step(q, k, v, g, beta, pool, state_indices=torch.tensor([0, 1, 2]), backend="torch")
    with pytest.raises(ValueError, match="pool"):
        kda_decode_step(q, k, v, g, beta, pool[:, :, :4], state_indices=torch.tensor([0, 1]), backend="torch")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_decode_gate_parameters_without_gate(backend):
    """A_log without a gate is an error on every backend, never silently dropped."""
    q, k, v, g, beta, h0 = make(2, 1, 1, 1, 16, 16, seed=19, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="A_log, dt_bias and lower_bound need gate"):
        kda_decode_step(q, k, v, g, beta, h0.clone(), A_log=torch.zeros(1, device=DEV), backend=backend)


# ---------------------------------------------------------------------------------------------------------------
# Beta as logits.


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_beta_logits_torch(chunk_size):
    """beta = sigmoid(logits) inside the op: outputs and the logits' gradient against the reference on the sigmoid."""
    inputs = make(2, 23, 1, 1, 8, 8, seed=17, logits=True)
    fn = lambda q, k, v, g, b, h0: chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                             chunk_size=chunk_size, use_beta_sigmoid=True, backend="torch")  # fmt: skip
    ref = lambda q, k, v, g, b, h0: recurrent_kda(q, k, v, g, torch.sigmoid(b), initial_state=h0,
                                                  output_final_state=True)  # fmt: skip
    compare(fn, ref, inputs, TOL64)


@needs_triton
def test_chunk_states_triton_while_training_are_a_copy():
    """The kernels' backward reads the buffer the states come from: writing into the returned states (NaN) must not
    change a gradient, and the outputs' gradients equal those of the plain call."""
    inputs = make(1, 70, 1, 1, 16, 16, seed=18, dtype=torch.float32, device=DEV)

    def poisoned(*x):
        o, S, states = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, backend="triton",
                                 return_chunk_states=True)  # fmt: skip
        states.fill_(float("nan"))
        return o, S

    plain = lambda *x: chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, backend="triton")
    _, _, grads = outputs_and_grads(poisoned, inputs)
    _, _, ref = outputs_and_grads(plain, inputs)
    for name, r in ref.items():
        assert torch.equal(grads[name], r), name
