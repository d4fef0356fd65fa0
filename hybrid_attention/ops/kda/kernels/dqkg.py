"""KDA chunk backward, stage 3: dq, dk, dg (or dz, dA_log, dt_bias with the fused gate) and beta's k-part, one program
per (K tile, chunk, head); docs/kernels.md, "Stages".
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    WIDE,
    anchor_factors,
    chunk_info,
    dot_operand,
    fitting_prefix,
    gate_parts,
    load_gate,
    load_lower,
    load_raw,
    load_rows,
    load_tile,
    mm,
    row_of,
    rows_or_one,
    store_rows,
    store_tile,
)
from hybrid_attention.ops.triton_support import autotune


@triton.jit
def _l2_back(dxh, xh, r, FUSE: tl.constexpr):
    """With FUSE (this program holds all of K): the l2norm backward r (dx^ - x^ (x^ . dx^)), from the normalised
    x^ and r = 1 / ||x||; otherwise dx^ itself (finished by _l2norm_bwd_kernel)."""
    if FUSE:
        return r[:, None] * (dxh - xh * tl.sum(xh * dxh, 1)[:, None])
    else:
        return dxh


@triton.jit
def _exact_diag_grads(dq_s, dk_s, dg_s, dA, dAk, qn, kn, G, wide):
    """Add the gradients of the diagonal-block pairs (t, j), j < t, of the wide rows t, pair by pair: the score
    x_tj = sum_c y_tc k_jc 2^(G_tc - G_jc) (y = q with dAqk, y = k with dAkk) gives dy_t += dA_tj k_j e,
    dk_j += dA_tj y_t e, and +-(dA_tj y_t k_j e) to dG_t and dG_j. One column token j per step; every exponent
    is <= 0. [64, BK] float32 tiles, dA and dAk [64, 64] as stored (a column at a time goes to float32)."""
    r = tl.arange(0, 64)
    blk = r // 16
    for j in range(64):
        row_j = (r == j)[:, None]
        kj = row_of(kn, j)
        Gj = row_of(G, j)
        pairs = wide & (r > j) & (blk == j // 16)
        e = tl.exp2(tl.where(pairs[:, None], G - Gj[None, :], float("-inf")))
        col_j = (r == j)[None, :]
        aq = tl.sum(tl.where(col_j, dA.to(tl.float32), 0.0), 1)[:, None]
        ak = tl.sum(tl.where(col_j, dAk.to(tl.float32), 0.0), 1)[:, None]
        ekj = e * kj[None, :]
        dq_s += aq * ekj
        dk_s += ak * ekj
        y = (aq * qn + ak * kn) * e  # [t, c]: the column side before k_j
        x = y * kj[None, :]
        dk_s += tl.where(row_j, tl.sum(y, 0)[None, :], 0.0)
        dg_s += x - tl.where(row_j, tl.sum(x, 0)[None, :], 0.0)
    return dq_s, dk_s, dg_s


@triton.jit
def _score_grads(
    dq_s, dk_s, dg_s, dA_f, dAk_f, qn, kn, G, rows, cols, ca, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr
):
    """Add the score gradients of the pairs (t, i), t in `rows`, i <= t in `cols` ([64] masks), anchored at ca
    ([1, BK]) by `anchor_factors` (the pairs whose clamped column factor would be wrong are dropped from dA_f,
    dAk_f). dA_f, dAk_f [64, 64] enter unmasked: the same dot operands for every anchor."""
    rowf, colf = anchor_factors(G, rows, cols, ca)
    kc = dot_operand(kn * colf, ADT, PREC)
    qr = dot_operand(qn * rowf, ADT, PREC)
    kr = dot_operand(kn * rowf, ADT, PREC)
    pq = mm(dA_f, kc, ADT, PREC, EMU)
    pk = mm(dAk_f, kc, ADT, PREC, EMU)
    pc = mm(tl.trans(dA_f), qr, ADT, PREC, EMU) + mm(tl.trans(dAk_f), kr, ADT, PREC, EMU)
    # Each score pair (t, i) adds x to dG_t (row factor) and -x to dG_i (column factor). Built from the dots' own
    # rounded operands, the pairs inside any suffix of the chunk cancel exactly in the reverse cumsum; from q * dq
    # and k * dk they cancel only to bf16 rounding, which the cumsum turned into relative errors in dg of 2.1e-2
    # (T = 300, K = V = 64) and 2.5e-2 (T = 4097, K = V = 128); 4.9e-3 and 4.8e-3 this way (bf16,
    # tests/ops/kda/bf16_accuracy.py: the Triton interpreter rounding as the GPU does).
    return dq_s + rowf * pq, dk_s + rowf * pk + colf * pc, dg_s + qr * pq + kr * pk - kc * pc


# Pipelined loads hide part of the latency of this register-bound kernel. The V tile is fixed
# (chunk_bwd.reduction_tile): the tuner's choice never changes the order of the sums.
@autotune([{}, {}], [(8, 2), (8, 3)], ["K", "V", "GATE", "NARROW", "L2NORM"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _dqkg_kernel(
    q,
    k,
    g,
    beta,
    a_log,
    dt_bias,
    rq,
    rk,  # inputs as the forward; rq, rk [T_total, H] 1/||q||, 1/||k||
    do,
    vnew,
    dvnew,
    hbuf,
    dhbuf,
    tm,
    daq,
    dak,  # dO, D, dD, S0, dS1, T, dAqk, dAkk (dtype ADT)
    dq,
    dk,
    dg,
    dbeta,
    dalog,
    dbias,  # dq, dk, dg [T_total, H, K]; dbeta [NK + 1, T_total, H]; partials [chunks, H, K]
    cu,
    chunk_seq,
    chunk_tok,
    scale,
    lower_bound,
    T,
    NT,
    T_tot,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    L2NORM: tl.constexpr,
    FUSE_L2: tl.constexpr,
    IO: tl.constexpr,
    ADT: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """dq, dk, dg (or dz and the gate's partial sums) and beta's k~ part of one (K tile, chunk, head), from the
    V contractions dO S0^T, D dS1^T, dD S0^T and the anchored score gradients (docs/kernels.md, "Stages")."""
    # Chunks on grid axis 0 (the only one without a 65535 cap); the K tiles of one chunk run side by side
    # so that their shared dO, D, dD and T reads hit L2. Every tile is a whole chunk ([64, BK] or [64, 64]):
    # the 16-token sub-chunks appear only as row masks, so the dots are M = 64 and few values stay live.
    ik = tl.program_id(0) % NK
    c = tl.program_id(0) // NK
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:
        return
    nv = eos - t0
    kk = ik * BK
    sk = H * K
    r = tl.arange(0, 64)
    blk = r // 16

    # ---- gate, normalised q and k of this K tile (recomputed as in the forward) ----
    G = tl.cumsum(load_gate(g + h * K, a_log, dt_bias, h, lower_bound, t0, nv, sk, kk, K, GATE, NARROW, 64, BK), 0)
    rqn = rows_or_one(rq + h, t0, nv, H, L2NORM)
    rkn = rows_or_one(rk + h, t0, nv, H, L2NORM)
    qn = load_tile(q + h * K, t0, nv, sk, kk, K, 64, BK) * rqn[:, None]
    kn = load_tile(k + h * K, t0, nv, sk, kk, K, 64, BK) * rkn[:, None]
    b = load_rows(beta + h, t0, nv, H, 64)

    # ---- through the score blocks: one anchor for the chunk's prefix that fits, one per row sub-chunk after it ----
    dA = load_lower(daq + h.to(tl.int64) * T_tot * 64, t0, nv)  # stored in ADT by stage 2
    dAk = load_lower(dak + h.to(tl.int64) * T_tot * 64, t0, nv)
    # The diagonal pairs (t, t) of Aqk carry no decay: they go straight to dq and dk, and add nothing to dG (through
    # the dots they would add x and -x to the same row, leaving the rounding of two sums).
    eye = r[:, None] == r[None, :]
    dA_diag = tl.sum(tl.where(eye, dA.to(tl.float32), 0.0), 1)
    # Wide rows (span from their sub-chunk's anchor above WIDE on this tile) take their diagonal-block pairs pair by
    # pair below; the dots skip those pairs (their column factors are clamped to 2^SHIFT, finite).
    dq_s = dA_diag[:, None] * kn  # score part of dq
    dk_s = dA_diag[:, None] * qn  # score part of dk, through the row (+G) and column (-G) factors
    dg_s = tl.zeros([64, BK], dtype=tl.float32)  # score part of dG
    drop = eye
    dAk_f = dAk
    if not NARROW:  # with NARROW no row is wide: the pair-by-pair path is not compiled
        wide = tl.zeros([64], dtype=tl.int1)
        for a in range(4):
            ca = row_of(G, 16 * a - 1)
            wide = wide | ((blk == a) & (tl.max(ca[None, :] - G, 1) > WIDE))
        if tl.max(wide.to(tl.int32), 0) > 0:  # before the dots: only the masked dAqk and dAkk stay live through them
            dq_s, dk_s, dg_s = _exact_diag_grads(dq_s, dk_s, dg_s, dA, dAk, qn, kn, G, wide)
            pairs = wide[:, None] & (blk[:, None] == blk[None, :])
            drop = drop | pairs
            dAk_f = tl.where(pairs, 0.0, dAk.to(tl.float32)).to(dAk.dtype)
    dA_f = tl.where(drop, 0.0, dA.to(tl.float32)).to(dA.dtype)
    # Rows t < f, the chunk's prefix whose span from the chunk's start, -G_t, is at most WIDE on this tile (G finite
    # and <= 0), share one anchor, the chunk's start: their pairs (t, i <= t) take one set of dots instead of one per
    # sub-chunk. f depends on rows up to f only, so a row's path, and its bits, never depend on later tokens.
    # Fast rows are never wide (their span from any anchor is at most -G_t).
    f = fitting_prefix(G)  # the first row that does not fit (64: all do)
    if f > 0:
        start = tl.zeros([1, BK], dtype=tl.float32)
        dq_s, dk_s, dg_s = _score_grads(dq_s, dk_s, dg_s, dA_f, dAk_f, qn, kn, G, r < f, r < f, start, ADT, PREC, EMU)
    for a in range(4):
        if f < 16 * a + 16:  # sub-chunk a holds rows from f on: anchored at c_a, the exponents of the forward
            ca = row_of(G, 16 * a - 1)  # G before sub-chunk a (0 for a = 0)
            dq_s, dk_s, dg_s = _score_grads(
                dq_s, dk_s, dg_s, dA_f, dAk_f, qn, kn, G, (blk == a) & (r >= f), blk <= a, ca[None, :], ADT, PREC, EMU
            )

    # ---- V contractions for this K tile ----
    dqg = tl.zeros([64, BK], dtype=tl.float32)
    dkg = tl.zeros([64, BK], dtype=tl.float32)
    dds = tl.zeros([64, BK], dtype=tl.float32)
    de = tl.zeros([BK], dtype=tl.float32)
    h_c = hbuf + (c * H + h).to(tl.int64) * K * V
    dh_c = dhbuf + (c * H + h).to(tl.int64) * K * V
    vn_h = vnew + h.to(tl.int64) * T_tot * V
    dvn_h = dvnew + h.to(tl.int64) * T_tot * V
    for vv in range(0, V, BV):
        s0 = load_raw(h_c, kk, K - kk, V, vv, V, BK, BV)
        s1 = load_raw(dh_c, kk, K - kk, V, vv, V, BK, BV)
        dqg += mm(load_raw(do + h * V, t0, nv, H * V, vv, V, 64, BV), tl.trans(s0), IO, PREC, EMU)
        dkg += mm(load_raw(vn_h, t0, nv, V, vv, V, 64, BV), tl.trans(s1), IO, PREC, EMU)
        dds += mm(load_raw(dvn_h, t0, nv, V, vv, V, 64, BV), tl.trans(s0), IO, PREC, EMU)
    # The state-product sum reads the state tiles in registers: in its own loop, one stage, since inside the
    # pipelined loop above Triton 3.6 made dk, dg and dbeta differ from run to run on Hopper (docs/kernels.md).
    for vv in tl.range(0, V, BV, num_stages=1):
        s0 = load_raw(h_c, kk, K - kk, V, vv, V, BK, BV)
        s1 = load_raw(dh_c, kk, K - kk, V, vv, V, BK, BV)
        de += tl.sum(s0.to(tl.float32) * s1.to(tl.float32), 1)
    dr = mm(tl.trans(load_lower(tm + h.to(tl.int64) * T_tot * 64, t0, nv)), dds, IO, PREC, EMU)  # R S0^T

    # ---- assemble dq, dk, dG; dg is the reverse cumulative sum of dG inside the chunk plus d Gam ----
    e = tl.exp2(G)
    gam = row_of(G, 63)  # rows past the end have g = 0
    decay = tl.exp2(gam[None, :] - G)
    dq_state = scale * e * dqg
    pos = -b[:, None] * e * dr  # state parts of dk whose factor holds +G
    neg = decay * dkg  # and -G
    dqn = dq_s + dq_state
    # The -G state terms k * dk enter every dg_s with s <= t through Gam = G_63 and dg_t through -G_t: their net is
    # the sum over rows before t (an exclusive cumsum), tiny where the decay is strong; adding the whole sum to
    # every row and taking it back per row would leave the rounding of O(1) terms in a small dg.
    negk = kn * neg
    dG = dg_s + qn * dq_state + kn * pos
    dgam = (tl.cumsum(negk, 0) - negk) + (de * tl.exp2(gam))[None, :]
    cm = (kk + tl.arange(0, BK)) < K
    dgl = tl.where((r < nv)[:, None] & cm[None, :], tl.cumsum(dG, 0, reverse=True) + dgam, 0.0)
    if GATE != 0:
        # dz = dg * (d g / d u), u = z + dt_bias; the per-chunk sums of dz and of dg * (d g / d A_log) feed dt_bias
        # and A_log. The gate's parts are recomputed from z here rather than kept from the start: fewer live tiles.
        _, dgdu, dgda = gate_parts(g + h * K, a_log, dt_bias, h, lower_bound, t0, nv, sk, kk, K, GATE, NARROW, 64, BK)
        dz = dgl * dgdu
        part = (c * H + h).to(tl.int64) * K + kk + tl.arange(0, BK)
        tl.store(dalog + part, tl.sum(dgl * dgda, 0), mask=cm)
        tl.store(dbias + part, tl.sum(dz, 0), mask=cm)
        dgl = dz
    db = -tl.sum(kn * e * dr, 1)  # the k~ part of d beta: -rowsum(k~ * (R S0^T)) (its Akk part: stage 2)
    store_rows(dbeta + (ik + 1).to(tl.int64) * T_tot * H + h, db, t0, nv, H, 64)
    store_tile(dq + h * K, _l2_back(dqn, qn, rqn, FUSE_L2), t0, nv, sk, kk, K, 64, BK)
    store_tile(dk + h * K, _l2_back(dk_s + pos + neg, kn, rkn, FUSE_L2), t0, nv, sk, kk, K, 64, BK)
    store_tile(dg + h * K, dgl, t0, nv, sk, kk, K, 64, BK)
