"""KDA chunk forward, stage 1: the chunk-local "prep" kernel, one program per chunk and head (Aqk, T, W, U, qg, kg,
Gam), as a plain path and a checked path for bad inputs (docs/kernels.md, "Stages" and "Numerics").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.kernels.regate import gated_tiles
from hybrid_attention.ops.kda.triton_utils import (
    L2_EPS,
    WIDE,
    all_finite,
    anchor_factors,
    chunk_info,
    finite,
    first_bad_row,
    fitting_prefix,
    inv_unit_lower4,
    load_gate,
    load_lower,
    load_rows,
    load_tile,
    mm,
    mm32,
    row_of,
    rows_or_one,
    store_lower,
    store_rows,
    store_tile,
)
from hybrid_attention.ops.triton_support import autotune


@triton.jit
def _l_block(ptr, A: tl.constexpr, B: tl.constexpr):
    """Block (A, B) of L from the chunk's [64, 64] float32 scratch."""
    return load_tile(ptr, 16 * A, 16, 64, 16 * B, 64, 16, 16)


@triton.jit
def _store_blk(ptr, x, t0, nv, A: tl.constexpr, B: tl.constexpr):
    """Block (A, B) of a chunk's [64, 64] matrix into its [rows, 64] storage."""
    store_tile(ptr, x, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)


@triton.jit
def _rstd(ss):
    """1 / sqrt(sum_c x^2 + eps) from the row sums of squares."""
    return 1.0 / tl.sqrt(ss + L2_EPS)


@triton.jit
def _anchored(q, k, G, rows, cols, ca, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """One K tile's part of Aqk and Akk ([64, 64]) for the pairs (t, i), t in `rows`, i in `cols` ([64] masks),
    anchored at ca ([1, BKA]): rows (q, k) times their row factors, columns k_i times theirs (`anchor_factors`)."""
    rowf, colf = anchor_factors(G, rows, cols, ca)
    kc = tl.trans(k * colf)
    return mm(q * rowf, kc, ADT, PREC, EMU), mm(k * rowf, kc, ADT, PREC, EMU)


@triton.jit
def _exact_pairs(aq, ak, q, k, G, wide):
    """Add one K tile's pairs (t, i), i <= t in t's sub-chunk, of the wide rows t ([64] mask) to Aqk and Akk, pair
    by pair: sum_c x_tc k_ic 2^(G_tc - G_ic) for x = q, k, every exponent <= 0, so any decay is exact. One column
    token i per step ([64, BKA] float32 tiles)."""
    r = tl.arange(0, 64)
    blk = r // 16
    for i in range(64):
        ki = row_of(k, i)
        Gi = row_of(G, i)
        pairs = wide & (r >= i) & (blk == i // 16)
        eki = tl.exp2(tl.where(pairs[:, None], G - Gi[None, :], float("-inf"))) * ki[None, :]
        col_i = (r == i)[None, :]
        aq += tl.where(col_i, tl.sum(q * eki, 1)[:, None], 0.0)
        ak += tl.where(col_i, tl.sum(k * eki, 1)[:, None], 0.0)
    return aq, ak


@triton.jit
def _scores(
    aq, ak, q, k, G, BK: tl.constexpr, NARROW: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr
):
    """Add one K tile to Aqk and Akk ([64, 64], not yet masked to the lower triangle; q, k, G [64, BKA] float32).

    The rows t < f, the chunk's prefix whose span from the chunk's start (-G_t) is at most WIDE on this tile (G
    finite and <= 0), share the chunk's start as their anchor: two M = 64 dots for all of them. The rows from f on
    (where the chunk's decay is strong) take the anchor c_a of their sub-chunk a, the cumulative gate before it: two
    dots per sub-chunk that holds such rows. f depends on the rows up to it only, so a
    row's path, and its bits, never depend on later tokens. A row whose span from c_a still exceeds WIDE (only where
    a step can fall below -WIDE / 16; never with NARROW) takes its own sub-chunk's pairs one by one instead."""
    r = tl.arange(0, 64)
    blk = r // 16
    f = fitting_prefix(G)
    if f > 0:
        pq, pk = _anchored(q, k, G, r < f, r < f, tl.zeros([1, BK], dtype=tl.float32), ADT, PREC, EMU)
        aq += pq
        ak += pk
    if f < 64:
        wide = tl.zeros([64], dtype=tl.int1)
        for a in range(4):
            if f < 16 * a + 16:  # sub-chunk a holds rows from f on
                ca = row_of(G, 16 * a - 1)[None, :]  # G before it (0 for a = 0)
                rows = (blk == a) & (r >= f)
                pq, pk = _anchored(q, k, G, rows, blk <= a, ca, ADT, PREC, EMU)
                if not NARROW:
                    wide_a = rows & (tl.max(ca - G, 1) > WIDE)
                    own = wide_a[:, None] & (blk == a)[None, :]  # pairs whose column factor may have been clamped
                    pq = tl.where(own, 0.0, pq)
                    pk = tl.where(own, 0.0, pk)
                    wide = wide | wide_a
                aq += pq
                ak += pk
        if not NARROW:  # noqa: SIM102 (a compile-time branch: the runtime test inside it must not be compiled either)
            if tl.max(wide.to(tl.int32), 0) > 0:
                aq, ak = _exact_pairs(aq, ak, q, k, G, wide)
    return aq, ak


@triton.jit
def _ok(akk, b, up):
    """Rows whose k, g and beta are usable: k_t . k_t (the diagonal of Akk, [64, 64]) finite (g enters through the
    anchors), beta in [0, 1] (false for NaN), no decay above 0."""
    r = tl.arange(0, 64)
    diag = tl.sum(tl.where(r[:, None] == r[None, :], akk, 0.0), 1)
    return finite(diag) & (b >= 0.0) & (b <= 1.0) & (up == 0)


@triton.jit
def _clean(x, row0, f, CHECKED: tl.constexpr):
    """Checked: rows at or after f (the first token with a non-finite k, g or beta) set to zero, so that a dot by a
    lower triangular matrix multiplies them by exact zeros only and earlier rows never see a NaN from later ones."""
    if CHECKED:
        x = tl.where((row0 + tl.arange(0, 16) < f)[:, None], x, 0.0)
    return x


@triton.jit
def _prep_chunk(
    c,
    h,
    t0,
    eos,
    q,
    k,
    v,
    g,
    beta,
    a_log,
    dt_bias,
    w,
    u,
    qg,
    kg,
    aqk,
    tm,
    glast,
    rq,
    rk,
    akk,
    fbad,
    lscr,
    scale,
    lower_bound,
    T_tot,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BKA: tl.constexpr,
    BKW: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    L2NORM: tl.constexpr,
    SAVE: tl.constexpr,
    IO: tl.constexpr,
    ADT: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
    CHECKED: tl.constexpr,
):
    """Every output of chunk c (first token t0, its sequence ending at eos), head h. Returns whether the chunk needs
    the checked path: a non-finite k, g, beta or v, beta outside [0, 1] or g > 0 on one of its rows (or a U tile whose
    sum overflows). The plain path (CHECKED false) computes the outputs as if every input were usable; the checked
    path keeps the rows before the first bad one exact and finite (see U below)."""
    n0 = eos - t0  # valid rows: r < n0 (tile loads mask the others)
    sk = H * K
    qh = q + h * K
    kh = k + h * K
    gh = g + h * K
    r = tl.arange(0, 64)
    b = load_rows(beta + h, t0, n0, H, 64)
    # ---- scores: Aqk and Akk as whole [64, 64] tiles, accumulated over K tiles ----
    aq = tl.zeros([64, 64], dtype=tl.float32)
    ak = tl.zeros([64, 64], dtype=tl.float32)
    # With the fused l2norm the dots take the raw q and k and the tiles are scaled afterwards by 1 / ||q_t|| and
    # 1 / ||k_i|| (rows and columns), so the norms come from the loads of this loop: no pass over q and k before it.
    ssq = tl.zeros([64], dtype=tl.float32)
    ssk = tl.zeros([64], dtype=tl.float32)
    # Rows with a decay g > 0 (a precomputed g; the gates give g <= 0): the kernels do not synchronise with the host to
    # raise, so such a row counts as a non-finite input (see fb below).
    up = tl.zeros([64], dtype=tl.int1)
    for kk in range(0, K, BKA):
        gt = load_gate(gh, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, NARROW, 64, BKA)
        if GATE == 0:
            up = up | (tl.max(gt, 1) > 0)
        G = tl.cumsum(gt, 0)
        kt = load_tile(kh, t0, n0, sk, kk, K, 64, BKA)
        qt = load_tile(qh, t0, n0, sk, kk, K, 64, BKA)
        if L2NORM:
            ssq += tl.sum(qt * qt, 1)
            ssk += tl.sum(kt * kt, 1)
        aq, ak = _scores(aq, ak, qt, kt, G, BKA, NARROW, ADT, PREC, EMU)

    if L2NORM:  # 1 / norms kept for the backward, and read back below as whole-chunk vectors
        rqv = _rstd(ssq)
        rkv = _rstd(ssk)
        store_rows(rq + h, rqv, t0, n0, H, 64)
        store_rows(rk + h, rkv, t0, n0, H, 64)
        aq = aq * rqv[:, None] * rkv[None, :]
        ak = ak * rkv[:, None] * rkv[None, :]

    # ---- fb: the first row with a non-finite k, g or beta (64 when none); its diagonal k_t . k_t is then non-finite
    # (g enters through the anchors). From fb on, this chunk's outputs and the state after it are not finite; the
    # dots by lower triangular matrices below take zeros there, so no earlier row sees a NaN or inf. ----
    fb = first_bad_row(_ok(ak, b, up), 0, 64)

    store_lower(aqk + h.to(tl.int64) * T_tot * 64, tl.where(r[:, None] >= r[None, :], aq * scale, 0.0), t0, n0)
    lower = r[:, None] > r[None, :]
    if SAVE:  # strictly lower Akk, for beta's score gradient in the backward (its dL * Akk row sums)
        store_lower(akk + h.to(tl.int64) * T_tot * 64, tl.where(lower, ak, 0.0), t0, n0)

    # ---- T = (I + L)^{-1}, L = Diag(beta) Akk, block by block ----
    # L goes through a float32 [64, 64] scratch so that the substitution reads the rows of its diagonal blocks back
    # and the merges below read its 16 x 16 blocks (all rows: beta is zero on rows past the end, so those rows of L
    # are zero).
    ld_c = lscr + (c * H + h).to(tl.int64) * 4096
    store_lower(ld_c, tl.where(lower, ak * b[:, None], 0.0), 0, 64)
    tl.debug_barrier()  # rows stored by one thread are read by all
    d0, d1, d2, d3 = inv_unit_lower4(ld_c)
    l10 = _l_block(ld_c, 1, 0)
    l20 = _l_block(ld_c, 2, 0)
    l21 = _l_block(ld_c, 2, 1)
    l30 = _l_block(ld_c, 3, 0)
    l31 = _l_block(ld_c, 3, 1)
    l32 = _l_block(ld_c, 3, 2)
    # T_ac = -T_aa sum_{c <= b < a} L_ab T_bc
    t10 = -mm32(d1, _clean(mm32(l10, d0, PREC), 16, fb, CHECKED), PREC)
    t21 = -mm32(d2, _clean(mm32(l21, d1, PREC), 32, fb, CHECKED), PREC)
    t20 = -mm32(d2, _clean(mm32(l20, d0, PREC) + mm32(l21, t10, PREC), 32, fb, CHECKED), PREC)
    t32 = -mm32(d3, _clean(mm32(l32, d2, PREC), 48, fb, CHECKED), PREC)
    t31 = -mm32(d3, _clean(mm32(l31, d1, PREC) + mm32(l32, t21, PREC), 48, fb, CHECKED), PREC)
    acc = mm32(l30, d0, PREC) + mm32(l31, t10, PREC) + mm32(l32, t20, PREC)
    t30 = -mm32(d3, _clean(acc, 48, fb, CHECKED), PREC)
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
    tmat = load_lower(tm_h, t0, n0, VECTOR=False)

    # ---- U = T Diag(beta) v, per V tile ----
    # T has a unit diagonal, so a non-finite row of T or of x = Diag(beta) v makes the sum of the tile T x
    # non-finite: that sum, and fb, tell whether this chunk needs the checked path.
    # Checked: from fb_all, the first row with a non-finite k, g, beta or v (v per V tile), W and U hold zeros, so
    # D = U - W S is finite and the lower triangular Aqk multiplies only finite rows into earlier ones; the NaN goes
    # into qg (the outputs from that row on) and Gam (the state after the chunk) instead. The plain tile is stored
    # first and redone with the bad rows zeroed, from a second load of v, only where the check fails, so that
    # neither the masks nor x stay live in the common case.
    u_h = u + h.to(tl.int64) * T_tot * V
    fb_all = fb
    needs_check = fb < 64
    for vv in range(0, V, BV):
        ut = mm(tmat, load_tile(v + h * V, t0, n0, H * V, vv, V, 64, BV) * b[:, None], IO, PREC, EMU)
        store_tile(u_h, ut, t0, n0, V, vv, V, 64, BV)
        bad_tile = finite(tl.sum(tl.sum(ut, 1), 0)) == 0
        if CHECKED:
            if (fb < 64) | bad_tile:
                x = load_tile(v + h * V, t0, n0, H * V, vv, V, 64, BV) * b[:, None]
                fv = tl.minimum(fb, first_bad_row(all_finite(x), 0, 64))
                keep = (r < fv)[:, None]
                ut = tl.where(keep, mm(tmat, tl.where(keep, x, 0.0), IO, PREC, EMU), 0.0)
                tl.debug_barrier()  # every thread's plain store is done before any masked one replaces it
                store_tile(u_h, ut, t0, n0, V, vv, V, 64, BV)
                fb_all = tl.minimum(fb_all, fv)
        else:
            needs_check = needs_check | bad_tile

    # ---- W = T Diag(beta) (k 2^G), qg, kg, Gam, per K tile (kernels/regate.py, which the backward runs again) ----
    rqn = rows_or_one(rq + h, t0, n0, H, L2NORM)  # stored above; visible to every thread after the barrier
    rkn = rows_or_one(rk + h, t0, n0, H, L2NORM)
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
        glast,
        tmat,
        b,
        rqn,
        rkn,
        fb_all,
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
        CHECKED,
        STORE_GAM=True,
    )
    if SAVE:  # the backward masks the same rows when it computes the gated tiles again
        tl.store(fbad + c * H + h, fb_all.to(tl.int32))
    return needs_check


# Two pipeline stages issue the next K tile's loads before this one's dots; two warps win at K = V = 64 and lose at
# 128, so both warp counts are tuned.
@autotune([{}, {}, {}], [(4, 2), (4, 1), (2, 1)], ["K", "V", "GATE", "NARROW", "L2NORM", "SAVE"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _prep_kernel(
    q,
    k,
    v,
    g,
    beta,
    a_log,
    dt_bias,  # inputs [T_total, H, *] (beta [T_total, H]); a_log [H], dt_bias [H, K]
    # outputs: W, qg, kg [H, T_total, K]; U [H, T_total, V]; Aqk, T, Akk [H, T_total, 64]; Gam [chunks, H, K] f32;
    # 1/||q||, 1/||k|| [T_total, H]; the first bad row [chunks, H] int32
    w,
    u,
    qg,
    kg,
    aqk,
    tm,
    glast,
    rq,
    rk,
    akk,
    fbad,
    lscr,  # float32 scratch [chunks, H, 64, 64]: L
    redo,  # int8 [chunks, H]: 1 where the chunk needs the checked path
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
    BKA: tl.constexpr,
    BKW: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    L2NORM: tl.constexpr,
    SAVE: tl.constexpr,
    IO: tl.constexpr,
    ADT: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """The plain path for every chunk, one program per (chunk, head), and the flag that sends it to the checked
    path."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:  # a spare grid slot (varlen)
        tl.store(redo + c * H + h, tl.zeros([], dtype=tl.int8))
        return
    bad = _prep_chunk(
        c,
        h,
        t0,
        eos,
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        w,
        u,
        qg,
        kg,
        aqk,
        tm,
        glast,
        rq,
        rk,
        akk,
        fbad,
        lscr,
        scale,
        lower_bound,
        T_tot,
        H,
        K,
        V,
        BKA,
        BKW,
        BV,
        GATE,
        NARROW,
        L2NORM,
        SAVE,
        IO,
        ADT,
        PREC,
        EMU,
        CHECKED=False,
    )
    tl.store(redo + c * H + h, bad.to(tl.int8))


@triton.jit(do_not_specialize=["T", "NT", "T_tot", "n_flags"])
def _prep_redo_kernel(
    q,
    k,
    v,
    g,
    beta,
    a_log,
    dt_bias,
    w,
    u,
    qg,
    kg,
    aqk,
    tm,
    glast,
    rq,
    rk,
    akk,
    fbad,
    lscr,
    redo,
    cu,
    chunk_seq,
    chunk_tok,
    scale,
    lower_bound,
    T,
    NT,
    T_tot,
    n_flags,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BKA: tl.constexpr,
    BKW: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    L2NORM: tl.constexpr,
    SAVE: tl.constexpr,
    IO: tl.constexpr,
    ADT: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
    FLAGS: tl.constexpr,
):
    """The checked path for the flagged (chunk, head) pairs only: each program reads FLAGS flags at once and redoes
    the pairs they mark, so that with none flagged (the common case) the launch costs one small load per program."""
    i0 = tl.program_id(0) * FLAGS
    idx = i0 + tl.arange(0, FLAGS)
    if tl.max((tl.load(redo + idx, mask=idx < n_flags, other=0) != 0).to(tl.int32), 0) > 0:
        for i in range(i0, tl.minimum(i0 + FLAGS, n_flags)):
            if tl.load(redo + i) != 0:
                c = i // H
                h = i % H
                seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
                if seq >= 0:  # a spare grid slot (varlen) holds no chunk, whatever its flag says
                    _prep_chunk(
                        c,
                        h,
                        t0,
                        eos,
                        q,
                        k,
                        v,
                        g,
                        beta,
                        a_log,
                        dt_bias,
                        w,
                        u,
                        qg,
                        kg,
                        aqk,
                        tm,
                        glast,
                        rq,
                        rk,
                        akk,
                        fbad,
                        lscr,
                        scale,
                        lower_bound,
                        T_tot,
                        H,
                        K,
                        V,
                        BKA,
                        BKW,
                        BV,
                        GATE,
                        NARROW,
                        L2NORM,
                        SAVE,
                        IO,
                        ADT,
                        PREC,
                        EMU,
                        CHECKED=True,
                    )
