"""The fused recurrent KDA step for decoding: a few tokens per sequence from a float32 state, updated in place.

Per (V tile, sequence, head) one program holds the [K, BV] slice of the state in registers and applies the
recurrence of docs/math.md token by token (S <- Diag(exp g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = scale S^T q_t), then writes the slice back. Decoding is bound by moving the state (read + write), so
everything else (gate, L2 norm) is fused in and the state is touched exactly once per call.

Inputs: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; with the gate (GATE 1 bounded, 2 softplus) A_log [H]
and dt_bias [H, K]. state [B, H, K, V] float32 is read and written in place; o [B, T, H, V]. With INDEXED, state is
a pool [P, H, K, V] and sequence b owns row rows[b] (int64 [B]); a negative entry is a padding slot, whose outputs
are zeros and which touches no row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import L2_EPS, load_state, state_slice, store_state


@triton.jit
def _step_kernel(
    q, k, v, g, beta, a_log, dt_bias, state, o,  # q, k, g [B, T, H, K]; v, o [B, T, H, V]; state [B or P, H, K, V] f32
    rows, scale, lower_bound, T,  # rows: int64 [B], the state row of each sequence (read only with INDEXED)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2NORM: tl.constexpr, INDEXED: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    soffs, smask = state_slice(iv, K, V, BK, BV)
    srow = b.to(tl.int64)
    live = b >= 0  # always true without a pool
    if INDEXED:
        slot = tl.load(rows + b)
        live = slot >= 0
        srow = tl.maximum(slot, 0)
    # live widened to a [BK, BV] block before the &: the interpreter refuses a block & scalar mask
    smask = smask & ((tl.zeros([BK, BV], dtype=tl.int32) + live.to(tl.int32)) != 0)
    S = load_state(state, srow * H + h, soffs, smask, True, K, V, BK, BV)
    if GATE != 0:
        bias = tl.load(dt_bias + h * K + rk, mask=mk, other=0.0).to(tl.float32)
        rate = tl.exp(tl.load(a_log + h).to(tl.float32))
    for t in range(0, T):
        row = ((b * T + t) * H + h).to(tl.int64)
        qt = tl.load(q + row * K + rk, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + row * K + rk, mask=mk, other=0.0).to(tl.float32)
        gt = tl.load(g + row * K + rk, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + row * V + rv, mask=mv, other=0.0).to(tl.float32)
        bt = tl.load(beta + row).to(tl.float32)
        if L2NORM:
            qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + L2_EPS)
            kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + L2_EPS)
        if GATE == 1:
            gt = tl.where(mk, lower_bound * tl.sigmoid(rate * (gt + bias)), 0.0)
        elif GATE == 2:
            u = gt + bias
            gt = tl.where(mk, -rate * tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(tl.minimum(u, 20.0)))), 0.0)
        S = S * tl.exp(gt)[:, None]
        vn = bt * (vt - tl.sum(S * kt[:, None], 0))  # beta_t (v_t - S^T k_t)
        S = S + kt[:, None] * vn[None, :]
        ot = tl.where(live, scale * tl.sum(S * qt[:, None], 0), 0.0)
        tl.store(o + row * V + rv, ot.to(o.dtype.element_ty), mask=mv)
    store_state(state, srow * H + h, S, soffs, smask, K, V)
