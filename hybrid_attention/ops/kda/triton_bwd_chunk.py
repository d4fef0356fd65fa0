"""KDA backward, stage 3 of 3: dq, dk, dg (or dz, dA_log, dt_bias with the fused gate) and beta's k-part,
one program per (K tile, chunk, head); then the host function that runs all three stages.

With S0 / dS1 the states / state gradients at the chunk's start / end (stage 1) and R = T^T dD (stage 2):

    dqg = dO S0^T     dkg = D dS1^T     dK~ = -beta * (T^T (dD S0^T))     (V-contractions, per K tile)
    q~ = q * 2^G, k~ = k * 2^G, kg = k * 2^(Gam - G)  ->  dq, dk and dG by the chain rule
    Aqk, Akk blocks (a, b) = rows (q, k) * 2^(G_a - c_a + SHIFT) times columns k_b * 2^(c_a - SHIFT - G_b)
      ->  dq, dk from dAqk, dAkk = beta * dL, with dG_row += x * dx_row and dG_col -= k * dk_col
    dg = reverse cumulative sum of dG over the chunk + dGam (Gam is the sum of the whole chunk's g)

The anchors c_a cancel in every product, so they carry no gradient. The l2norm backward needs a full-K dot per
row, so with the fused l2norm dq, dk leave this kernel in float32 and a small row kernel finishes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_bwd import score_grad, state_bwd
from hybrid_attention.ops.kda.triton_fwd import TL_DTYPES
from hybrid_attention.ops.kda.triton_utils import (
    LOG2E,
    SHIFT,
    ChunkLayout,
    autotune,
    chunk_info,
    dot_setup,
    empty,
    load_raw,
    load_rows,
    load_tile,
    mm,
    store_tile,
)


@triton.jit
def _gate_parts(g, a_log, dt_bias, h, lower_bound, row0, nrows, stride, col0, K, GATE: tl.constexpr,
                R: tl.constexpr, C: tl.constexpr):  # fmt: skip
    """(log2 decay, d g / d x, x) of a tile, x = exp(A_log) (z + dt_bias) the pre-sigmoid gate (GATE only)."""
    x = load_tile(g, row0, nrows, stride, col0, K, R, C)
    if GATE:
        r = tl.arange(0, R)
        c = col0 + tl.arange(0, C)
        bias = tl.load(dt_bias + h * K + c, mask=c < K, other=0.0).to(tl.float32)
        xx = tl.exp(tl.load(a_log + h).to(tl.float32)) * (x + bias[None, :])
        s = tl.sigmoid(xx)
        gn = tl.where((r < nrows)[:, None] & (c < K)[None, :], lower_bound * s, 0.0)
        return gn * LOG2E, lower_bound * s * (1.0 - s), xx
    else:
        return x * LOG2E, x, x


@triton.jit
def _pair_bwd(dqr, dkr, dkcol, dbk, daq, dl, t0, nv, A: tl.constexpr, B: tl.constexpr, ba, qr, kr, kb, Gb, ca,
              ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):  # fmt: skip
    """Gradients through score block (A, B): Aqk_AB = qr kc^T and Akk_AB = kr kc^T, kc = k_B * fc."""
    dA = load_raw(daq, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)
    dLb = load_raw(dl, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)
    fc = tl.exp2(ca[None, :] - SHIFT - Gb)
    kc = kb * fc
    dAk = dLb * ba[:, None]
    dqr += mm(dA, kc, ADT, PREC, EMU)
    dkr += mm(dAk, kc, ADT, PREC, EMU)
    dkc = mm(tl.trans(dA), qr, ADT, PREC, EMU) + mm(tl.trans(dAk), kr, ADT, PREC, EMU)
    dkcol += dkc * fc
    dbk += tl.sum(dLb * mm(kr, tl.trans(kc), ADT, PREC, EMU), 1)  # d beta_t += sum_i dL[t, i] Akk[t, i]
    return dqr, dkr, dkcol, dbk


@triton.jit
def _tt(t, x, IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    return mm(tl.trans(t), x, IO, PREC, EMU)


@triton.jit
def _rows_f32(ptr, row0, nrows, H, L2NORM: tl.constexpr):
    if L2NORM:
        return load_rows(ptr, row0, nrows, H, 16)
    else:
        return tl.full([16], 1.0, dtype=tl.float32)


@triton.jit
def _l2_back(dxh, xh, r, FUSE: tl.constexpr):
    """With FUSE (this program holds all of K): the l2norm backward r (dx^ - x^ (x^ . dx^)), from the normalised
    x^ and r = 1 / ||x||; otherwise dx^ itself (finished by _l2norm_bwd_kernel)."""
    if FUSE:
        return r[:, None] * (dxh - xh * tl.sum(xh * dxh, 1)[:, None])
    else:
        return dxh


@triton.jit
def _finish(dG, valid, dgz, x, GATE: tl.constexpr):
    """Mask a sub-chunk's dg to its valid rows; with GATE turn it into (dz, d x) for the gate's parameters."""
    dG = tl.where(valid, dG, 0.0)
    if GATE:
        dx = dG * dgz
        return dx, dx * x
    else:
        return dG, dG


@autotune([{"BV": 32}, {"BV": 64}, {"BV": 32}], [(4, 1), (8, 1), (8, 1)], ["K", "V", "GATE", "L2NORM"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _dqkg_kernel(
    q, k, g, beta, a_log, dt_bias, rq, rk,  # inputs as the forward; rq, rk [T_total, H] 1/||q||, 1/||k||
    do, vnew, dvnew, hbuf, dhbuf, tm, daq, dl,  # dO, D, dD, S0, dS1, T, dAqk, dL
    dq, dk, dg, dbeta, dalog, dbias,  # dq, dk, dg [T_total, H, K]; dbeta [NK + 1, T_total, H]; partials [chunks, H, K]
    cu, chunk_seq, chunk_tok, scale, lower_bound, T, NT, T_tot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr, FUSE_L2: tl.constexpr,
    IO: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    # Chunks on grid axis 0 (the only one without a 65535 cap); the K tiles of one chunk run side by side
    # so that their shared dO, D, dD and T reads hit L2.
    ik = tl.program_id(0) % NK
    c = tl.program_id(0) // NK
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:
        return
    n0 = eos - t0
    n1 = n0 - 16
    n2 = n0 - 32
    n3 = n0 - 48
    kk = ik * BK

    # ---- V contractions for this K tile ----
    zk = tl.zeros([16, BK], dtype=tl.float32)
    dqg0 = zk
    dqg1 = zk
    dqg2 = zk
    dqg3 = zk
    dkg0 = zk
    dkg1 = zk
    dkg2 = zk
    dkg3 = zk
    dds0 = zk
    dds1 = zk
    dds2 = zk
    dds3 = zk
    de = tl.zeros([BK], dtype=tl.float32)
    h_c = hbuf + (c * H + h).to(tl.int64) * K * V
    dh_c = dhbuf + (c * H + h).to(tl.int64) * K * V
    vn_h = vnew + h.to(tl.int64) * T_tot * V
    dvn_h = dvnew + h.to(tl.int64) * T_tot * V
    for vv in range(0, V, BV):
        s0 = load_raw(h_c, kk, K - kk, V, vv, V, BK, BV)
        s1 = load_raw(dh_c, kk, K - kk, V, vv, V, BK, BV)
        de += tl.sum(s0.to(tl.float32) * s1.to(tl.float32), 1)
        s0t = tl.trans(s0)
        s1t = tl.trans(s1)
        dqg0 += mm(load_raw(do + h * V, t0, n0, H * V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dqg1 += mm(load_raw(do + h * V, t0 + 16, n1, H * V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dqg2 += mm(load_raw(do + h * V, t0 + 32, n2, H * V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dqg3 += mm(load_raw(do + h * V, t0 + 48, n3, H * V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dkg0 += mm(load_raw(vn_h, t0, n0, V, vv, V, 16, BV), s1t, IO, PREC, EMU)
        dkg1 += mm(load_raw(vn_h, t0 + 16, n1, V, vv, V, 16, BV), s1t, IO, PREC, EMU)
        dkg2 += mm(load_raw(vn_h, t0 + 32, n2, V, vv, V, 16, BV), s1t, IO, PREC, EMU)
        dkg3 += mm(load_raw(vn_h, t0 + 48, n3, V, vv, V, 16, BV), s1t, IO, PREC, EMU)
        dds0 += mm(load_raw(dvn_h, t0, n0, V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dds1 += mm(load_raw(dvn_h, t0 + 16, n1, V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dds2 += mm(load_raw(dvn_h, t0 + 32, n2, V, vv, V, 16, BV), s0t, IO, PREC, EMU)
        dds3 += mm(load_raw(dvn_h, t0 + 48, n3, V, vv, V, 16, BV), s0t, IO, PREC, EMU)

    # R S0^T = T^T (dD S0^T), block by block
    tm_h = tm + h.to(tl.int64) * T_tot * 64
    dr0 = _tt(load_raw(tm_h, t0, n0, 64, 0, 64, 16, 16), dds0, IO, PREC, EMU)
    dr0 += _tt(load_raw(tm_h, t0 + 16, n1, 64, 0, 64, 16, 16), dds1, IO, PREC, EMU)
    dr0 += _tt(load_raw(tm_h, t0 + 32, n2, 64, 0, 64, 16, 16), dds2, IO, PREC, EMU)
    dr0 += _tt(load_raw(tm_h, t0 + 48, n3, 64, 0, 64, 16, 16), dds3, IO, PREC, EMU)
    dr1 = _tt(load_raw(tm_h, t0 + 16, n1, 64, 16, 64, 16, 16), dds1, IO, PREC, EMU)
    dr1 += _tt(load_raw(tm_h, t0 + 32, n2, 64, 16, 64, 16, 16), dds2, IO, PREC, EMU)
    dr1 += _tt(load_raw(tm_h, t0 + 48, n3, 64, 16, 64, 16, 16), dds3, IO, PREC, EMU)
    dr2 = _tt(load_raw(tm_h, t0 + 32, n2, 64, 32, 64, 16, 16), dds2, IO, PREC, EMU)
    dr2 += _tt(load_raw(tm_h, t0 + 48, n3, 64, 32, 64, 16, 16), dds3, IO, PREC, EMU)
    dr3 = _tt(load_raw(tm_h, t0 + 48, n3, 64, 48, 64, 16, 16), dds3, IO, PREC, EMU)

    # ---- gates, keys, queries of this K tile (recomputed as in the forward) ----
    sk = H * K
    gh = g + h * K
    g0, dz0, x0 = _gate_parts(gh, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, 16, BK)
    g1, dz1, x1 = _gate_parts(gh, a_log, dt_bias, h, lower_bound, t0 + 16, n1, sk, kk, K, GATE, 16, BK)
    g2, dz2, x2 = _gate_parts(gh, a_log, dt_bias, h, lower_bound, t0 + 32, n2, sk, kk, K, GATE, 16, BK)
    g3, dz3, x3 = _gate_parts(gh, a_log, dt_bias, h, lower_bound, t0 + 48, n3, sk, kk, K, GATE, 16, BK)
    c0 = tl.zeros([BK], dtype=tl.float32)
    c1 = tl.sum(g0, 0)
    c2 = c1 + tl.sum(g1, 0)
    c3 = c2 + tl.sum(g2, 0)
    gam = c3 + tl.sum(g3, 0)
    G0 = tl.cumsum(g0, 0)
    G1 = tl.cumsum(g1, 0) + c1[None, :]
    G2 = tl.cumsum(g2, 0) + c2[None, :]
    G3 = tl.cumsum(g3, 0) + c3[None, :]
    qh = q + h * K
    kh = k + h * K
    rq0 = _rows_f32(rq + h, t0, n0, H, L2NORM)
    rq1 = _rows_f32(rq + h, t0 + 16, n1, H, L2NORM)
    rq2 = _rows_f32(rq + h, t0 + 32, n2, H, L2NORM)
    rq3 = _rows_f32(rq + h, t0 + 48, n3, H, L2NORM)
    rk0 = _rows_f32(rk + h, t0, n0, H, L2NORM)
    rk1 = _rows_f32(rk + h, t0 + 16, n1, H, L2NORM)
    rk2 = _rows_f32(rk + h, t0 + 32, n2, H, L2NORM)
    rk3 = _rows_f32(rk + h, t0 + 48, n3, H, L2NORM)
    q0 = load_tile(qh, t0, n0, sk, kk, K, 16, BK) * rq0[:, None]
    q1 = load_tile(qh, t0 + 16, n1, sk, kk, K, 16, BK) * rq1[:, None]
    q2 = load_tile(qh, t0 + 32, n2, sk, kk, K, 16, BK) * rq2[:, None]
    q3 = load_tile(qh, t0 + 48, n3, sk, kk, K, 16, BK) * rq3[:, None]
    k0 = load_tile(kh, t0, n0, sk, kk, K, 16, BK) * rk0[:, None]
    k1 = load_tile(kh, t0 + 16, n1, sk, kk, K, 16, BK) * rk1[:, None]
    k2 = load_tile(kh, t0 + 32, n2, sk, kk, K, 16, BK) * rk2[:, None]
    k3 = load_tile(kh, t0 + 48, n3, sk, kk, K, 16, BK) * rk3[:, None]
    b0 = load_rows(beta + h, t0, n0, H, 16)
    b1 = load_rows(beta + h, t0 + 16, n1, H, 16)
    b2 = load_rows(beta + h, t0 + 32, n2, H, 16)
    b3 = load_rows(beta + h, t0 + 48, n3, H, 16)
    f0 = tl.exp2(G0 + SHIFT)
    f1 = tl.exp2(G1 - c1[None, :] + SHIFT)
    f2 = tl.exp2(G2 - c2[None, :] + SHIFT)
    f3 = tl.exp2(G3 - c3[None, :] + SHIFT)
    qr0 = q0 * f0
    qr1 = q1 * f1
    qr2 = q2 * f2
    qr3 = q3 * f3
    kr0 = k0 * f0
    kr1 = k1 * f1
    kr2 = k2 * f2
    kr3 = k3 * f3

    # ---- through the score blocks ----
    daq_h = daq + h.to(tl.int64) * T_tot * 64
    dl_h = dl + h.to(tl.int64) * T_tot * 64
    dqr0 = zk
    dqr1 = zk
    dqr2 = zk
    dqr3 = zk
    dkr0 = zk
    dkr1 = zk
    dkr2 = zk
    dkr3 = zk
    dkc0 = zk
    dkc1 = zk
    dkc2 = zk
    dkc3 = zk
    z16 = tl.zeros([16], dtype=tl.float32)
    db0 = z16
    db1 = z16
    db2 = z16
    db3 = z16
    dqr0, dkr0, dkc0, db0 = _pair_bwd(dqr0, dkr0, dkc0, db0, daq_h, dl_h, t0, n0, 0, 0, b0, qr0, kr0, k0, G0, c0,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr1, dkr1, dkc0, db1 = _pair_bwd(dqr1, dkr1, dkc0, db1, daq_h, dl_h, t0, n0, 1, 0, b1, qr1, kr1, k0, G0, c1,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr1, dkr1, dkc1, db1 = _pair_bwd(dqr1, dkr1, dkc1, db1, daq_h, dl_h, t0, n0, 1, 1, b1, qr1, kr1, k1, G1, c1,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr2, dkr2, dkc0, db2 = _pair_bwd(dqr2, dkr2, dkc0, db2, daq_h, dl_h, t0, n0, 2, 0, b2, qr2, kr2, k0, G0, c2,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr2, dkr2, dkc1, db2 = _pair_bwd(dqr2, dkr2, dkc1, db2, daq_h, dl_h, t0, n0, 2, 1, b2, qr2, kr2, k1, G1, c2,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr2, dkr2, dkc2, db2 = _pair_bwd(dqr2, dkr2, dkc2, db2, daq_h, dl_h, t0, n0, 2, 2, b2, qr2, kr2, k2, G2, c2,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr3, dkr3, dkc0, db3 = _pair_bwd(dqr3, dkr3, dkc0, db3, daq_h, dl_h, t0, n0, 3, 0, b3, qr3, kr3, k0, G0, c3,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr3, dkr3, dkc1, db3 = _pair_bwd(dqr3, dkr3, dkc1, db3, daq_h, dl_h, t0, n0, 3, 1, b3, qr3, kr3, k1, G1, c3,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr3, dkr3, dkc2, db3 = _pair_bwd(dqr3, dkr3, dkc2, db3, daq_h, dl_h, t0, n0, 3, 2, b3, qr3, kr3, k2, G2, c3,
                                      ADT, PREC, EMU)  # fmt: skip
    dqr3, dkr3, dkc3, db3 = _pair_bwd(dqr3, dkr3, dkc3, db3, daq_h, dl_h, t0, n0, 3, 3, b3, qr3, kr3, k3, G3, c3,
                                      ADT, PREC, EMU)  # fmt: skip

    # ---- assemble dq, dk, dG per sub-chunk ----
    e0 = tl.exp2(G0)
    e1 = tl.exp2(G1)
    e2 = tl.exp2(G2)
    e3 = tl.exp2(G3)
    dq0 = f0 * dqr0 + scale * e0 * dqg0
    dq1 = f1 * dqr1 + scale * e1 * dqg1
    dq2 = f2 * dqr2 + scale * e2 * dqg2
    dq3 = f3 * dqr3 + scale * e3 * dqg3
    kd0 = k0 * tl.exp2(gam[None, :] - G0) * dkg0  # k * (the kg part of dk): enters dG with -, dGam with +
    kd1 = k1 * tl.exp2(gam[None, :] - G1) * dkg1
    kd2 = k2 * tl.exp2(gam[None, :] - G2) * dkg2
    kd3 = k3 * tl.exp2(gam[None, :] - G3) * dkg3
    pos0 = f0 * dkr0 - b0[:, None] * e0 * dr0  # parts of dk whose factor holds +G
    pos1 = f1 * dkr1 - b1[:, None] * e1 * dr1
    pos2 = f2 * dkr2 - b2[:, None] * e2 * dr2
    pos3 = f3 * dkr3 - b3[:, None] * e3 * dr3
    neg0 = dkc0 + tl.exp2(gam[None, :] - G0) * dkg0  # parts whose factor holds -G
    neg1 = dkc1 + tl.exp2(gam[None, :] - G1) * dkg1
    neg2 = dkc2 + tl.exp2(gam[None, :] - G2) * dkg2
    neg3 = dkc3 + tl.exp2(gam[None, :] - G3) * dkg3
    dG0 = q0 * dq0 + k0 * (pos0 - neg0)
    dG1 = q1 * dq1 + k1 * (pos1 - neg1)
    dG2 = q2 * dq2 + k2 * (pos2 - neg2)
    dG3 = q3 * dq3 + k3 * (pos3 - neg3)
    dgam = tl.sum(kd0, 0) + tl.sum(kd1, 0) + tl.sum(kd2, 0) + tl.sum(kd3, 0) + de * tl.exp2(gam)
    sum3 = tl.sum(dG3, 0)
    sum2 = sum3 + tl.sum(dG2, 0)
    sum1 = sum2 + tl.sum(dG1, 0)
    r16 = tl.arange(0, 16)
    cm = (kk + tl.arange(0, BK)) < K
    dg0, da0 = _finish(tl.cumsum(dG0, 0, reverse=True) + (sum1 + dgam)[None, :], (r16 < n0)[:, None] & cm, dz0,
                       x0, GATE)  # fmt: skip
    dg1, da1 = _finish(tl.cumsum(dG1, 0, reverse=True) + (sum2 + dgam)[None, :], (r16 < n1)[:, None] & cm, dz1,
                       x1, GATE)  # fmt: skip
    dg2, da2 = _finish(tl.cumsum(dG2, 0, reverse=True) + (sum3 + dgam)[None, :], (r16 < n2)[:, None] & cm, dz2,
                       x2, GATE)  # fmt: skip
    dg3, da3 = _finish(tl.cumsum(dG3, 0, reverse=True) + dgam[None, :], (r16 < n3)[:, None] & cm, dz3, x3, GATE)
    if GATE:
        # dz = dg * (d g / d x) * exp(A_log); the per-chunk sums of dz and dz * (z + bias) feed dt_bias and A_log.
        rate = tl.exp(tl.load(a_log + h).to(tl.float32))
        cols = kk + tl.arange(0, BK)
        part = (c * H + h).to(tl.int64) * K + cols
        tl.store(dalog + part, tl.sum(da0, 0) + tl.sum(da1, 0) + tl.sum(da2, 0) + tl.sum(da3, 0), mask=cm)
        tl.store(dbias + part, (tl.sum(dg0, 0) + tl.sum(dg1, 0) + tl.sum(dg2, 0) + tl.sum(dg3, 0)) * rate, mask=cm)
        dg0 = dg0 * rate
        dg1 = dg1 * rate
        dg2 = dg2 * rate
        dg3 = dg3 * rate

    db0 -= tl.sum(k0 * e0 * dr0, 1)  # the k~ part of d beta: -rowsum(k~ * (R S0^T))
    db1 -= tl.sum(k1 * e1 * dr1, 1)
    db2 -= tl.sum(k2 * e2 * dr2, 1)
    db3 -= tl.sum(k3 * e3 * dr3, 1)
    dbs = dbeta + (ik + 1).to(tl.int64) * T_tot * H + h
    tl.store(dbs + (t0 + r16) * H, db0, mask=r16 < n0)
    tl.store(dbs + (t0 + 16 + r16) * H, db1, mask=r16 < n1)
    tl.store(dbs + (t0 + 32 + r16) * H, db2, mask=r16 < n2)
    tl.store(dbs + (t0 + 48 + r16) * H, db3, mask=r16 < n3)
    store_tile(dq + h * K, _l2_back(dq0, q0, rq0, FUSE_L2), t0, n0, sk, kk, K, 16, BK)
    store_tile(dq + h * K, _l2_back(dq1, q1, rq1, FUSE_L2), t0 + 16, n1, sk, kk, K, 16, BK)
    store_tile(dq + h * K, _l2_back(dq2, q2, rq2, FUSE_L2), t0 + 32, n2, sk, kk, K, 16, BK)
    store_tile(dq + h * K, _l2_back(dq3, q3, rq3, FUSE_L2), t0 + 48, n3, sk, kk, K, 16, BK)
    store_tile(dk + h * K, _l2_back(pos0 + neg0, k0, rk0, FUSE_L2), t0, n0, sk, kk, K, 16, BK)
    store_tile(dk + h * K, _l2_back(pos1 + neg1, k1, rk1, FUSE_L2), t0 + 16, n1, sk, kk, K, 16, BK)
    store_tile(dk + h * K, _l2_back(pos2 + neg2, k2, rk2, FUSE_L2), t0 + 32, n2, sk, kk, K, 16, BK)
    store_tile(dk + h * K, _l2_back(pos3 + neg3, k3, rk3, FUSE_L2), t0 + 48, n3, sk, kk, K, 16, BK)
    store_tile(dg + h * K, dg0, t0, n0, sk, kk, K, 16, BK)
    store_tile(dg + h * K, dg1, t0 + 16, n1, sk, kk, K, 16, BK)
    store_tile(dg + h * K, dg2, t0 + 32, n2, sk, kk, K, 16, BK)
    store_tile(dg + h * K, dg3, t0 + 48, n3, sk, kk, K, 16, BK)


@triton.jit
def _l2norm_bwd_kernel(x, rstd, dy, dx, n_rows, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """y = x * rstd, rstd = 1 / sqrt(|x|^2 + eps)  ->  dx = rstd * (dy - y (y . dy)), per row of K."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    r = tl.load(rstd + rows, mask=rows < n_rows, other=0.0)
    y = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) * r[:, None]
    d = tl.load(dy + offs, mask=mask, other=0.0)
    tl.store(dx + offs, (r[:, None] * (d - y * tl.sum(y * d, 1)[:, None])).to(dx.dtype.element_ty), mask=mask)


def _l2norm_bwd(x, rstd, dy):
    """x [..., K] (input dtype), rstd [...] f32, dy [..., K] f32 -> dx [..., K] in x.dtype."""
    K = x.shape[-1]
    n_rows = x.numel() // K
    dx = empty(x, *x.shape)
    BK = max(16, triton.next_power_of_2(K))
    BR = max(1, 4096 // BK)
    _l2norm_bwd_kernel[(triton.cdiv(n_rows, BR),)](x, rstd, dy, dx, n_rows, K=K, BR=BR, BK=BK, num_warps=4)
    return dx


def kda_bwd(do, dht, q, k, v, g, beta, a_log, dt_bias, h0_needed, cu_seqlens, saved, *, scale, lower_bound,
            gate, l2norm):  # fmt: skip
    """All three backward stages. do [B, T, H, V], dht [N, H, K, V] f32 or None; inputs as `kda_fwd`.

    Returns dq, dk, dv, dg (dz with the gate), dbeta in the dtypes of their inputs, dh0 [N, H, K, V] f32
    (empty unless h0_needed), and dA_log [H], d dt_bias [H, K] float32 (empty without the gate).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    T_tot = B * T
    io = v.dtype
    q, k, v, g = (x.reshape(T_tot, H, x.shape[-1]).contiguous() for x in (q, k, v, g))
    beta = beta.reshape(T_tot, H).contiguous()
    do = do.reshape(T_tot, H, V).to(io).contiguous()
    dht = None if dht is None else dht.float().contiguous()
    layout = ChunkLayout(B, T, q.device, cu_seqlens)
    prec, emu, a32 = dot_setup(io)
    dtypes = (TL_DTYPES[io], tl.float32 if a32 else TL_DTYPES[io], prec, emu)
    dh0, dhbuf, dvnew = state_bwd(saved, do, dht, h0_needed, layout, K=K, V=V, dtypes=dtypes)

    BK = min(64, max(16, triton.next_power_of_2(K)))
    NK = triton.cdiv(K, BK)
    f32 = torch.float32
    dbeta = empty(q, NK + 1, T_tot, H, dtype=f32)
    dv, daq, dl = score_grad(saved, do, dvnew, v, beta, dbeta[0], layout, scale=scale, dtypes=dtypes)

    fuse_l2 = l2norm and NK == 1  # one K tile holds the whole row: the l2norm backward runs in the same kernel
    dq = empty(q, T_tot, H, K, dtype=f32 if (l2norm and not fuse_l2) else q.dtype)
    dk = empty(k, T_tot, H, K, dtype=f32 if (l2norm and not fuse_l2) else k.dtype)
    dg = empty(g, *g.shape)
    none = empty(q, 0, dtype=f32)
    parts = (lambda: torch.zeros(layout.n_chunks, H, K, device=q.device, dtype=f32)) if gate else (lambda: none)
    dalog, dbias = parts(), parts()
    cu, chunk_seq, chunk_tok, _, Tn, NT = layout.args()
    _dqkg_kernel[(layout.n_chunks * NK, H)](
        q, k, g, beta, a_log if gate else none, dt_bias if gate else none,
        saved["rq"] if l2norm else none, saved["rk"] if l2norm else none,
        do, saved["vnew"], dvnew, saved["h"], dhbuf, saved["tm"], daq, dl,
        dq, dk, dg, dbeta, dalog, dbias,
        cu, chunk_seq, chunk_tok, scale, lower_bound, Tn, NT, T_tot,
        H=H, K=K, V=V, BK=BK, NK=NK, VARLEN=layout.varlen, GATE=gate, L2NORM=l2norm, FUSE_L2=fuse_l2,
        IO=dtypes[0], ADT=dtypes[1], PREC=prec, EMU=emu,
    )  # fmt: skip
    if l2norm and not fuse_l2:
        dq = _l2norm_bwd(q, saved["rq"], dq)
        dk = _l2norm_bwd(k, saved["rk"], dk)
    shape = lambda x: x.view(B, T, H, x.shape[-1])
    dbeta = dbeta.sum(0).view(B, T, H).to(beta.dtype)
    da_log = dalog.sum((0, 2)) if gate else none
    ddt = dbias.sum(0) if gate else none
    return shape(dq), shape(dk), shape(dv), shape(dg), dbeta, dh0, da_log, ddt
