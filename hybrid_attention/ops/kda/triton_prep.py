"""KDA forward, stage 1 of 2: the chunk-local "prep" kernel (one program per chunk and head, all in parallel).

For a chunk of 64 tokens (MATH.md, "Chunkwise form"; G = in-chunk cumulative log2 gate, Gam = G at its end):

    Akk[t, i] = sum_c k_tc k_ic 2^(G_tc - G_ic) (i < t)   Aqk[t, i] = scale * sum_c q_tc k_ic 2^(G_tc - G_ic) (i <= t)
    T = (I + Diag(beta) Akk)^{-1}       W = T Diag(beta) (k * 2^G)       U = T Diag(beta) v
    qg = scale * q * 2^G      kg = k * 2^(Gam - G)

Written out: Aqk and T ([rows, 64] per head), W, U, qg, kg (head-major [H, T_total, *]), Gam per chunk and,
with the fused l2norm, 1 / ||q|| and 1 / ||k|| per row. The 64 x 64 matrices are built from 16 x 16 blocks
(a, b), b <= a, each anchored at c_a, the cumulative gate before sub-chunk a (see triton_utils). The inverse
is forward substitution inside the four diagonal blocks (float32) and block products below them.
Optional fusions: the bounded gate from raw logits (GATE) and the q/k L2 norm (L2NORM).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    L2_EPS,
    SHIFT,
    autotune,
    chunk_info,
    inv_unit_lower4,
    load_gate,
    load_lower,
    load_rows,
    load_tile,
    mm,
    mm32,
    store_tile,
)


@triton.jit
def _rstd(x, row0, nrows, stride, K, BK: tl.constexpr, L2NORM: tl.constexpr, R: tl.constexpr):
    """1 / sqrt(sum_c x^2 + eps) for R rows (ones without L2NORM)."""
    if L2NORM:
        ss = tl.zeros([R], dtype=tl.float32)
        for kk in range(0, K, BK):
            t = load_tile(x, row0, nrows, stride, kk, K, R, BK)
            ss += tl.sum(t * t, 1)
        return 1.0 / tl.sqrt(ss + L2_EPS)
    else:
        return tl.full([R], 1.0, dtype=tl.float32)


@triton.jit
def _load_blk(ptr, t0, nv, A: tl.constexpr, B: tl.constexpr):
    """Block (A, B) of a chunk's [64, 64] float32 matrix from its [rows, 64] storage (zero past the rows)."""
    return load_tile(ptr, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)


@triton.jit
def _store_blk(ptr, x, t0, nv, A: tl.constexpr, B: tl.constexpr):
    """Block (A, B) of a chunk's [64, 64] matrix into its [rows, 64] storage."""
    store_tile(ptr, x, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)


@autotune([{}, {}], [(4, 1), (8, 1)], ["K", "V", "GATE", "L2NORM", "SAVE"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _prep_kernel(
    q, k, v, g, beta, a_log, dt_bias,  # inputs [T_total, H, *] (beta [T_total, H]); a_log [H], dt_bias [H, K]
    w, u, qg, kg, aqk, tm, glast, rq, rk, lk,  # outputs (see the module docstring); lk: float32 scratch
    cu, chunk_seq, chunk_tok,
    scale, lower_bound, T, NT, T_tot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKA: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr, SAVE: tl.constexpr,
    IO: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:
        return
    n0 = eos - t0
    sk = H * K
    qh = q + h * K
    kh = k + h * K
    gh = g + h * K
    r = tl.arange(0, 64)
    blk = r // 16
    rqn = _rstd(qh, t0, n0, sk, K, BKA, L2NORM, 64)
    rkn = _rstd(kh, t0, n0, sk, K, BKA, L2NORM, 64)
    if L2NORM and SAVE:
        tl.store(rq + (t0 + r) * H + h, rqn, mask=r < n0)
        tl.store(rk + (t0 + r) * H + h, rkn, mask=r < n0)
    b = load_rows(beta + h, t0, n0, H, 64)

    # ---- scores Aqk, Akk: whole-chunk M = 64 dots, one per row sub-chunk a and K tile, anchored at c_a ----
    aq = tl.zeros([64, 64], dtype=tl.float32)
    ak = tl.zeros([64, 64], dtype=tl.float32)
    for kk in range(0, K, BKA):
        G = tl.cumsum(load_gate(gh, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, 64, BKA), 0)
        qn = load_tile(qh, t0, n0, sk, kk, K, 64, BKA) * rqn[:, None]
        kn = load_tile(kh, t0, n0, sk, kk, K, 64, BKA) * rkn[:, None]
        for a in range(4):
            ca = tl.sum(tl.where((r == 16 * a - 1)[:, None], G, 0.0), 0)  # G before sub-chunk a (0 for a = 0)
            # Rows of a times columns up to a: 2^(G_t - c_a + SHIFT) 2^(c_a - SHIFT - G_i) = 2^(G_t - G_i);
            # elsewhere the exponent is -inf, so no overflowed factor meets a zero.
            rowf = tl.exp2(tl.where((blk == a)[:, None], G - ca[None, :] + SHIFT, float("-inf")))
            kc = tl.trans(kn * tl.exp2(tl.where((blk <= a)[:, None], ca[None, :] - SHIFT - G, float("-inf"))))
            aq += mm(qn * rowf, kc, ADT, PREC, EMU)
            ak += mm(kn * rowf, kc, ADT, PREC, EMU)
    aqk_h = aqk + h.to(tl.int64) * T_tot * 64
    store_tile(aqk_h, tl.where(r[:, None] >= r[None, :], aq * scale, 0.0), t0, n0, 64, 0, 64, 64, 64)

    # ---- T = (I + L)^{-1}, L = Diag(beta) Akk (strictly lower), block by block ----
    # L goes through a float32 scratch to be read back as 16 x 16 blocks (registers cannot be sliced).
    lk_h = lk + h.to(tl.int64) * T_tot * 64
    store_tile(lk_h, tl.where(r[:, None] > r[None, :], ak * b[:, None], 0.0), t0, n0, 64, 0, 64, 64, 64)
    tl.debug_barrier()
    d0, d1, d2, d3 = inv_unit_lower4(
        _load_blk(lk_h, t0, n0, 0, 0), _load_blk(lk_h, t0, n0, 1, 1),
        _load_blk(lk_h, t0, n0, 2, 2), _load_blk(lk_h, t0, n0, 3, 3),
    )  # fmt: skip
    l10 = _load_blk(lk_h, t0, n0, 1, 0)
    l20 = _load_blk(lk_h, t0, n0, 2, 0)
    l21 = _load_blk(lk_h, t0, n0, 2, 1)
    l30 = _load_blk(lk_h, t0, n0, 3, 0)
    l31 = _load_blk(lk_h, t0, n0, 3, 1)
    l32 = _load_blk(lk_h, t0, n0, 3, 2)
    # T_ac = -T_aa sum_{c <= b < a} L_ab T_bc
    t10 = -mm32(d1, mm32(l10, d0, PREC), PREC)
    t21 = -mm32(d2, mm32(l21, d1, PREC), PREC)
    t20 = -mm32(d2, mm32(l20, d0, PREC) + mm32(l21, t10, PREC), PREC)
    t32 = -mm32(d3, mm32(l32, d2, PREC), PREC)
    t31 = -mm32(d3, mm32(l31, d1, PREC) + mm32(l32, t21, PREC), PREC)
    acc = mm32(l30, d0, PREC) + mm32(l31, t10, PREC) + mm32(l32, t20, PREC)
    t30 = -mm32(d3, acc, PREC)
    # T goes to memory as a whole [64, 64] block-lower matrix and comes back as one tile, so that W and U are
    # single M = 64 dots per K / V tile (the barrier makes the other threads' stores visible).
    tm_h = tm + h.to(tl.int64) * T_tot * 64
    _store_blk(tm_h, d0, t0, n0, 0, 0)
    _store_blk(tm_h, t10, t0, n0, 1, 0)
    _store_blk(tm_h, d1, t0, n0, 1, 1)
    _store_blk(tm_h, t20, t0, n0, 2, 0)
    _store_blk(tm_h, t21, t0, n0, 2, 1)
    _store_blk(tm_h, d2, t0, n0, 2, 2)
    _store_blk(tm_h, t30, t0, n0, 3, 0)
    _store_blk(tm_h, t31, t0, n0, 3, 1)
    _store_blk(tm_h, t32, t0, n0, 3, 2)
    _store_blk(tm_h, d3, t0, n0, 3, 3)
    tl.debug_barrier()
    tmat = load_lower(tm_h, t0, n0)

    # ---- W = T Diag(beta) (k 2^G), qg, kg, Gam, per K tile ----
    w_h = w + h.to(tl.int64) * T_tot * K
    qg_h = qg + h.to(tl.int64) * T_tot * K
    kg_h = kg + h.to(tl.int64) * T_tot * K
    for kk in range(0, K, BKW):
        G = tl.cumsum(load_gate(gh, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, 64, BKW), 0)
        gam = tl.sum(tl.where((r == 63)[:, None], G, 0.0), 0)  # rows past the end have g = 0
        e = tl.exp2(G)
        kn = load_tile(kh, t0, n0, sk, kk, K, 64, BKW) * rkn[:, None]
        qn = load_tile(qh, t0, n0, sk, kk, K, 64, BKW) * rqn[:, None]
        store_tile(qg_h, qn * e * scale, t0, n0, K, kk, K, 64, BKW)
        store_tile(kg_h, kn * tl.exp2(gam[None, :] - G), t0, n0, K, kk, K, 64, BKW)
        store_tile(w_h, mm(tmat, kn * e * b[:, None], IO, PREC, EMU), t0, n0, K, kk, K, 64, BKW)
        cols = kk + tl.arange(0, BKW)
        tl.store(glast + (c * H + h).to(tl.int64) * K + cols, gam, mask=cols < K)

    # ---- U = T Diag(beta) v, per V tile ----
    u_h = u + h.to(tl.int64) * T_tot * V
    for vv in range(0, V, BV):
        x = load_tile(v + h * V, t0, n0, H * V, vv, V, 64, BV) * b[:, None]
        store_tile(u_h, mm(tmat, x, IO, PREC, EMU), t0, n0, V, vv, V, 64, BV)


def prep_fwd(q, k, v, g, beta, a_log, dt_bias, out, layout, *, scale, lower_bound, gate, l2norm, save, dtypes):
    """Launch the prep kernel. q, k, g [T_total, H, K]; v [T_total, H, V]; beta [T_total, H] (contiguous).
    `out` holds the preallocated outputs w, u, qg, kg, aqk, tm, glast, rq, rk and the scratch lk (see allocate_fwd);
    `dtypes` = (IO, ADT, PREC, EMU)."""
    T_tot, H, K = q.shape
    V = v.shape[-1]
    IO, ADT, PREC, EMU = dtypes
    BKA = min(32, max(16, triton.next_power_of_2(K)))
    BKW = min(64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    cu, chunk_seq, chunk_tok, _, T, NT = layout.args()
    _prep_kernel[(layout.n_chunks, H)](
        q, k, v, g, beta, a_log, dt_bias,
        out["w"], out["u"], out["qg"], out["kg"], out["aqk"], out["tm"], out["glast"], out["rq"], out["rk"], out["lk"],
        cu, chunk_seq, chunk_tok,
        scale, lower_bound, T, NT, T_tot,
        H=H, K=K, V=V, BKA=BKA, BKW=BKW, BV=BV,
        VARLEN=layout.varlen, GATE=gate, L2NORM=l2norm, SAVE=save,
        IO=IO, ADT=ADT, PREC=PREC, EMU=EMU,
    )  # fmt: skip
