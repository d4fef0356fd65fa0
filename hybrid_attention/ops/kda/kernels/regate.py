"""KDA chunk: the gated tiles W, qg and kg of a chunk, written by the forward's prep kernel and again by the backward
(`_regate_kernel`) instead of being kept between them (docs/kernels.md, "Kept, and recomputed").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    chunk_info,
    load_gate,
    load_lower,
    load_rows,
    load_tile,
    mm,
    row_of,
    rows_or_one,
    store_tile,
)


@triton.jit
def gated_tiles(
    c,
    h,
    t0,
    n0,
    q,
    k,
    g,
    a_log,
    dt_bias,
    w,
    qg,
    kg,
    glast,
    tmat,
    b,
    rqn,
    rkn,
    fb,
    scale,
    lower_bound,
    T_tot,
    H: tl.constexpr,
    K: tl.constexpr,
    BKW: tl.constexpr,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    IO: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
    CHECKED: tl.constexpr,
    STORE_GAM: tl.constexpr,
):
    """W, qg, kg of chunk c (rows t0 .. t0 + n0 - 1), head h, per K tile of BKW columns, and with STORE_GAM its Gam
    into glast [chunks, H, K] (NaN for a chunk with a bad row). tmat: T [64, 64] as stored; b: beta [64]; rqn,
    rkn: 1 / ||q||, 1 / ||k|| per row (ones without the l2norm). CHECKED: mask the rows from fb on (see above)."""
    r = tl.arange(0, 64)
    sk = H * K
    w_h = w + h.to(tl.int64) * T_tot * K
    qg_h = qg + h.to(tl.int64) * T_tot * K
    kg_h = kg + h.to(tl.int64) * T_tot * K
    if CHECKED:
        good = (r < fb)[:, None]  # all true when no row is bad, and then the selects below change no bit
        qnan = tl.where(r < fb, 1.0, float("nan"))  # NaN rows by a product, not by a select on the whole tile
    for kk in range(0, K, BKW):
        G = tl.cumsum(load_gate(g + h * K, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, NARROW, 64, BKW), 0)
        gam = row_of(G, 63)  # rows past the end have g = 0
        e = tl.exp2(G)
        kn = load_tile(k + h * K, t0, n0, sk, kk, K, 64, BKW) * rkn[:, None]
        qn = load_tile(q + h * K, t0, n0, sk, kk, K, 64, BKW) * rqn[:, None]
        qgt = qn * e * scale
        if CHECKED:
            qgt = qgt * qnan[:, None]
        store_tile(qg_h, qgt, t0, n0, K, kk, K, 64, BKW)
        store_tile(kg_h, kn * tl.exp2(gam[None, :] - G), t0, n0, K, kk, K, 64, BKW)
        if CHECKED:
            wt = tl.where(good, mm(tmat, tl.where(good, kn * e * b[:, None], 0.0), IO, PREC, EMU), 0.0)
        else:
            wt = mm(tmat, kn * e * b[:, None], IO, PREC, EMU)
        store_tile(w_h, wt, t0, n0, K, kk, K, 64, BKW)
        if STORE_GAM:
            cols = kk + tl.arange(0, BKW)
            if CHECKED:
                gam = tl.where(fb < 64, float("nan"), gam)  # rows past the end are never bad: 64 means none
            tl.store(glast + (c * H + h).to(tl.int64) * K + cols, gam, mask=cols < K)


@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _regate_kernel(
    q,
    k,
    g,
    beta,
    a_log,
    dt_bias,
    tm,
    rq,
    rk,
    fbad,  # forward inputs and what it kept (fbad int32 [chunks, H])
    w,
    qg,
    kg,  # outputs [H, T_total, K] in the input dtype
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
    BKW: tl.constexpr,
    VARLEN: tl.constexpr,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    L2NORM: tl.constexpr,
    IO: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """W, qg, kg of every chunk again, one program per (chunk, head), as the forward computed them."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq >= 0:  # else a spare grid slot (varlen)
        n0 = eos - t0
        b = load_rows(beta + h, t0, n0, H, 64)
        tmat = load_lower(tm + h.to(tl.int64) * T_tot * 64, t0, n0)
        rqn = rows_or_one(rq + h, t0, n0, H, L2NORM)
        rkn = rows_or_one(rk + h, t0, n0, H, L2NORM)
        fb = tl.load(fbad + c * H + h)
        # CHECKED is a compile-time switch (the masked build is slower), so each chunk-head takes one of two calls.
        if fb < 64:
            gated_tiles(
                c,
                h,
                t0,
                n0,
                q,
                k,
                g,
                a_log,
                dt_bias,
                w,
                qg,
                kg,
                fbad,
                tmat,
                b,
                rqn,
                rkn,
                fb,
                scale,
                lower_bound,
                T_tot,
                H,
                K,
                BKW,
                GATE,
                NARROW,
                IO,
                PREC,
                EMU,
                CHECKED=True,
                STORE_GAM=False,
            )
        else:
            gated_tiles(
                c,
                h,
                t0,
                n0,
                q,
                k,
                g,
                a_log,
                dt_bias,
                w,
                qg,
                kg,
                fbad,
                tmat,
                b,
                rqn,
                rkn,
                fb,
                scale,
                lower_bound,
                T_tot,
                H,
                K,
                BKW,
                GATE,
                NARROW,
                IO,
                PREC,
                EMU,
                CHECKED=False,
                STORE_GAM=False,
            )
