"""KDA chunk forward, stage 1: the chunk-local "prep" kernel (one program per chunk and head, all in parallel).

For a chunk of 64 tokens (docs/math.md, "Chunkwise form"; G = in-chunk cumulative log2 gate, Gam = G at its end):

    Akk[t, i] = sum_c k_tc k_ic 2^(G_tc - G_ic) (i < t)   Aqk[t, i] = scale * sum_c q_tc k_ic 2^(G_tc - G_ic) (i <= t)
    T = (I + Diag(beta) Akk)^{-1}       W = T Diag(beta) (k * 2^G)       U = T Diag(beta) v
    qg = scale * q * 2^G      kg = k * 2^(Gam - G)

Written out: Aqk and T ([rows, 64] per head; T always, the W / U phase reads it back), W, U, qg, kg (head-major
[H, T_total, *]), Gam per chunk, with the fused l2norm 1 / ||q|| and 1 / ||k|| per row, and when saving for the
backward the strictly lower Akk ([rows, 64]). A float32 scratch [chunks, H, 64, 16] holds the diagonal blocks of L.
The 64 x 64 matrices are built from 16 x 16 blocks (a, b), b <= a, each anchored at c_a, the cumulative gate before
sub-chunk a (see triton_utils). The inverse is forward substitution inside the four diagonal blocks (float32, their
rows read back from the scratch) and block products below them.
Optional fusions: the bounded gate from raw logits (GATE) and the q/k L2 norm (L2NORM; the score dots take the raw
q and k, and the blocks are scaled by the norms afterwards, summed from the same loads).

Two kernels share the body `_prep_chunk`: `_prep_kernel`, the plain path for every chunk, which also flags the
chunks whose inputs it cannot take (a non-finite k, g, beta or v; beta outside [0, 1]; g > 0), and
`_prep_redo_kernel`, the checked path, which computes the flagged chunks again with the masks that keep the rows
before the first bad one exact (docs/kernels.md, "Non-finite inputs").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    L2_EPS,
    SHIFT,
    WIDE,
    all_finite,
    autotune,
    chunk_info,
    exact_diag,
    finite,
    first_bad_row,
    inv_unit_lower4,
    load_gate,
    load_lower,
    load_rows,
    load_tile,
    mm,
    mm32,
    rows_or_one,
    store_rows,
    store_tile,
    tril,
)


@triton.jit
def _rstd(ss):
    """1 / sqrt(sum_c x^2 + eps) from the row sums of squares."""
    return 1.0 / tl.sqrt(ss + L2_EPS)


@triton.jit
def _norm_pair(aq, ak, rq_a, rk_a, rk_b):
    """Blocks (a, b) of Aqk and Akk from raw q, k to normalised: rows times 1 / ||q_t|| (1 / ||k_t||), columns times
    1 / ||k_i||."""
    return aq * rq_a[:, None] * rk_b[None, :], ak * rk_a[:, None] * rk_b[None, :]


@triton.jit
def _acc_pair(aq, ak, qr, kr, kb, Gb, ca, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """Add one K tile to block (a, b) of Aqk and Akk: rows qr, kr = (q, k) * 2^(G_a - c_a + SHIFT),
    columns k_b * 2^(c_a - SHIFT - G_b). The product of the two factors is exactly 2^(G_t - G_i)."""
    kc = tl.trans(kb * tl.exp2(ca[None, :] - SHIFT - Gb))
    return aq + mm(qr, kc, ADT, PREC, EMU), ak + mm(kr, kc, ADT, PREC, EMU)


@triton.jit
def _acc_diag(aq, ak, q, k, qr, kr, G, ca, wide, NARROW: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr,
              EMU: tl.constexpr):  # fmt: skip
    """Add one K tile to the diagonal block (a, a): the anchored dots, and for the rows whose span exceeds WIDE
    (`wide`, [16]) the pair-by-pair block instead (those rows of the dots may hold inf or NaN, never used). With
    NARROW no row is wide, and the pair-by-pair path is not compiled (it would hold registers the dots need)."""
    kc = tl.trans(k * tl.exp2(ca[None, :] - SHIFT - G))
    fq = mm(qr, kc, ADT, PREC, EMU)
    fk = mm(kr, kc, ADT, PREC, EMU)
    if not NARROW:  # noqa: SIM102 (a compile-time branch: the runtime test inside it must not be compiled either)
        if tl.max(wide.to(tl.int32), 0) > 0:
            eq, ek = exact_diag(q, k, G)
            fq = tl.where(wide[:, None], eq, fq)
            fk = tl.where(wide[:, None], ek, fk)
    return aq + fq, ak + fk


@triton.jit
def _wide_rows(G, ca, NARROW: tl.constexpr):
    """Rows whose span from the anchor, max_c (c_a - G_tc), exceeds WIDE on this K tile (none with NARROW)."""
    if NARROW:
        return tl.zeros([16], dtype=tl.int1)
    else:
        return tl.max(ca[None, :] - G, 1) > WIDE


@triton.jit
def _clean(x, row0, f, CHECKED: tl.constexpr):
    """Checked: rows at or after f (the first token with a non-finite k, g or beta) set to zero, so that a dot by a
    lower triangular matrix multiplies them by exact zeros only and earlier rows never see a NaN from later ones."""
    if CHECKED:
        x = tl.where((row0 + tl.arange(0, 16) < f)[:, None], x, 0.0)
    return x


@triton.jit
def _diag(x):
    """The diagonal of a [16, 16] block."""
    r = tl.arange(0, 16)
    return tl.sum(tl.where(r[:, None] == r[None, :], x, 0.0), 1)


@triton.jit
def _ok(akk_diag_block, b, up):
    """Rows whose k, g and beta are usable: k_t . k_t finite (g enters through the anchors), beta in [0, 1] (false
    for NaN), no decay above 0."""
    return finite(_diag(akk_diag_block)) & (b >= 0.0) & (b <= 1.0) & (up == 0)


@triton.jit
def _store_blk(ptr, x, t0, nv, A: tl.constexpr, B: tl.constexpr):
    """Block (A, B) of a chunk's [64, 64] matrix into its [rows, 64] storage."""
    store_tile(ptr, x, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)


@triton.jit
def _prep_chunk(
    c, h, t0, eos,
    q, k, v, g, beta, a_log, dt_bias, w, u, qg, kg, aqk, tm, glast, rq, rk, akk, ldiag, scale, lower_bound, T_tot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKA: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NARROW: tl.constexpr, L2NORM: tl.constexpr, SAVE: tl.constexpr,
    IO: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, CHECKED: tl.constexpr,
):  # fmt: skip
    """Every output of chunk c (first token t0, its sequence ending at eos), head h. Returns whether the chunk needs
    the checked path: a non-finite k, g, beta or v, beta outside [0, 1] or g > 0 on one of its rows (or a U tile whose
    sum overflows). The plain path (CHECKED false) computes the outputs as if every input were usable; the checked
    path keeps the rows before the first bad one exact and finite (see U below)."""
    # Valid rows of sub-chunk a are those below n_a (tile loads mask r < n_a for r in [0, 16)).
    n0 = eos - t0
    n1 = n0 - 16
    n2 = n0 - 32
    n3 = n0 - 48
    sk = H * K
    qh = q + h * K
    kh = k + h * K
    gh = g + h * K
    b0 = load_rows(beta + h, t0, n0, H, 16)
    b1 = load_rows(beta + h, t0 + 16, n1, H, 16)
    b2 = load_rows(beta + h, t0 + 32, n2, H, 16)
    b3 = load_rows(beta + h, t0 + 48, n3, H, 16)
    # ---- scores: 10 blocks (a, b), b <= a, of Aqk and Akk, accumulated over K tiles ----
    zero = tl.zeros([16, 16], dtype=tl.float32)
    aq00 = zero
    ak00 = zero
    aq10 = zero
    ak10 = zero
    aq11 = zero
    ak11 = zero
    aq20 = zero
    ak20 = zero
    aq21 = zero
    ak21 = zero
    aq22 = zero
    ak22 = zero
    aq30 = zero
    ak30 = zero
    aq31 = zero
    ak31 = zero
    aq32 = zero
    ak32 = zero
    aq33 = zero
    ak33 = zero
    # With the fused l2norm the dots take the raw q and k and the blocks are scaled afterwards by 1 / ||q_t|| and
    # 1 / ||k_i|| (rows and columns), so the norms come from the loads of this loop: no pass over q and k before it.
    ssq0 = tl.zeros([16], dtype=tl.float32)
    ssq1 = ssq0
    ssq2 = ssq0
    ssq3 = ssq0
    ssk0 = ssq0
    ssk1 = ssq0
    ssk2 = ssq0
    ssk3 = ssq0
    # Rows with a decay g > 0 (a precomputed g; the gates give g <= 0): the kernels do not synchronise with the host to
    # raise, so such a row counts as a non-finite input (see fb below).
    up0 = tl.zeros([16], dtype=tl.int1)
    up1 = up0
    up2 = up0
    up3 = up0
    for kk in range(0, K, BKA):
        g0 = load_gate(gh, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, NARROW, 16, BKA)
        g1 = load_gate(gh, a_log, dt_bias, h, lower_bound, t0 + 16, n1, sk, kk, K, GATE, NARROW, 16, BKA)
        g2 = load_gate(gh, a_log, dt_bias, h, lower_bound, t0 + 32, n2, sk, kk, K, GATE, NARROW, 16, BKA)
        g3 = load_gate(gh, a_log, dt_bias, h, lower_bound, t0 + 48, n3, sk, kk, K, GATE, NARROW, 16, BKA)
        if GATE == 0:
            up0 = up0 | (tl.max(g0, 1) > 0)
            up1 = up1 | (tl.max(g1, 1) > 0)
            up2 = up2 | (tl.max(g2, 1) > 0)
            up3 = up3 | (tl.max(g3, 1) > 0)
        c0 = tl.zeros([BKA], dtype=tl.float32)
        c1 = tl.sum(g0, 0)
        c2 = c1 + tl.sum(g1, 0)
        c3 = c2 + tl.sum(g2, 0)
        G0 = tl.cumsum(g0, 0)
        G1 = tl.cumsum(g1, 0) + c1[None, :]
        G2 = tl.cumsum(g2, 0) + c2[None, :]
        G3 = tl.cumsum(g3, 0) + c3[None, :]
        f0 = tl.exp2(G0 + SHIFT)
        f1 = tl.exp2(G1 - c1[None, :] + SHIFT)
        f2 = tl.exp2(G2 - c2[None, :] + SHIFT)
        f3 = tl.exp2(G3 - c3[None, :] + SHIFT)
        k0 = load_tile(kh, t0, n0, sk, kk, K, 16, BKA)
        k1 = load_tile(kh, t0 + 16, n1, sk, kk, K, 16, BKA)
        k2 = load_tile(kh, t0 + 32, n2, sk, kk, K, 16, BKA)
        k3 = load_tile(kh, t0 + 48, n3, sk, kk, K, 16, BKA)
        q0 = load_tile(qh, t0, n0, sk, kk, K, 16, BKA)
        q1 = load_tile(qh, t0 + 16, n1, sk, kk, K, 16, BKA)
        q2 = load_tile(qh, t0 + 32, n2, sk, kk, K, 16, BKA)
        q3 = load_tile(qh, t0 + 48, n3, sk, kk, K, 16, BKA)
        if L2NORM:
            ssq0 += tl.sum(q0 * q0, 1)
            ssq1 += tl.sum(q1 * q1, 1)
            ssq2 += tl.sum(q2 * q2, 1)
            ssq3 += tl.sum(q3 * q3, 1)
            ssk0 += tl.sum(k0 * k0, 1)
            ssk1 += tl.sum(k1 * k1, 1)
            ssk2 += tl.sum(k2 * k2, 1)
            ssk3 += tl.sum(k3 * k3, 1)
        # A row is "wide" when its span from the sub-chunk's anchor exceeds WIDE on some channel: the anchored
        # factors could overflow, so its diagonal block row is computed pair by pair (depends on its prefix only).
        w0 = _wide_rows(G0, c0, NARROW)
        w1 = _wide_rows(G1, c1, NARROW)
        w2 = _wide_rows(G2, c2, NARROW)
        w3 = _wide_rows(G3, c3, NARROW)
        qr0 = q0 * f0
        qr1 = q1 * f1
        qr2 = q2 * f2
        qr3 = q3 * f3
        kr0 = k0 * f0
        kr1 = k1 * f1
        kr2 = k2 * f2
        kr3 = k3 * f3
        aq00, ak00 = _acc_diag(aq00, ak00, q0, k0, qr0, kr0, G0, c0, w0, NARROW, ADT, PREC, EMU)
        aq10, ak10 = _acc_pair(aq10, ak10, qr1, kr1, k0, G0, c1, ADT, PREC, EMU)
        aq11, ak11 = _acc_diag(aq11, ak11, q1, k1, qr1, kr1, G1, c1, w1, NARROW, ADT, PREC, EMU)
        aq20, ak20 = _acc_pair(aq20, ak20, qr2, kr2, k0, G0, c2, ADT, PREC, EMU)
        aq21, ak21 = _acc_pair(aq21, ak21, qr2, kr2, k1, G1, c2, ADT, PREC, EMU)
        aq22, ak22 = _acc_diag(aq22, ak22, q2, k2, qr2, kr2, G2, c2, w2, NARROW, ADT, PREC, EMU)
        aq30, ak30 = _acc_pair(aq30, ak30, qr3, kr3, k0, G0, c3, ADT, PREC, EMU)
        aq31, ak31 = _acc_pair(aq31, ak31, qr3, kr3, k1, G1, c3, ADT, PREC, EMU)
        aq32, ak32 = _acc_pair(aq32, ak32, qr3, kr3, k2, G2, c3, ADT, PREC, EMU)
        aq33, ak33 = _acc_diag(aq33, ak33, q3, k3, qr3, kr3, G3, c3, w3, NARROW, ADT, PREC, EMU)

    if L2NORM:  # 1 / norms kept for the backward, and read back below as whole-chunk vectors
        rq0 = _rstd(ssq0)
        rq1 = _rstd(ssq1)
        rq2 = _rstd(ssq2)
        rq3 = _rstd(ssq3)
        rk0 = _rstd(ssk0)
        rk1 = _rstd(ssk1)
        rk2 = _rstd(ssk2)
        rk3 = _rstd(ssk3)
        store_rows(rq + h, rq0, t0, n0, H, 16)
        store_rows(rq + h, rq1, t0 + 16, n1, H, 16)
        store_rows(rq + h, rq2, t0 + 32, n2, H, 16)
        store_rows(rq + h, rq3, t0 + 48, n3, H, 16)
        store_rows(rk + h, rk0, t0, n0, H, 16)
        store_rows(rk + h, rk1, t0 + 16, n1, H, 16)
        store_rows(rk + h, rk2, t0 + 32, n2, H, 16)
        store_rows(rk + h, rk3, t0 + 48, n3, H, 16)
        aq00, ak00 = _norm_pair(aq00, ak00, rq0, rk0, rk0)
        aq10, ak10 = _norm_pair(aq10, ak10, rq1, rk1, rk0)
        aq11, ak11 = _norm_pair(aq11, ak11, rq1, rk1, rk1)
        aq20, ak20 = _norm_pair(aq20, ak20, rq2, rk2, rk0)
        aq21, ak21 = _norm_pair(aq21, ak21, rq2, rk2, rk1)
        aq22, ak22 = _norm_pair(aq22, ak22, rq2, rk2, rk2)
        aq30, ak30 = _norm_pair(aq30, ak30, rq3, rk3, rk0)
        aq31, ak31 = _norm_pair(aq31, ak31, rq3, rk3, rk1)
        aq32, ak32 = _norm_pair(aq32, ak32, rq3, rk3, rk2)
        aq33, ak33 = _norm_pair(aq33, ak33, rq3, rk3, rk3)

    # ---- fb: the first row with a non-finite k, g or beta (64 when none); its diagonal k_t . k_t is then non-finite
    # (g enters through the anchors). From fb on, this chunk's outputs and the state after it are not finite; the
    # dots by lower triangular matrices below take zeros there, so no earlier row sees a NaN or inf. ----
    fb = first_bad_row(_ok(ak00, b0, up0), 0, 16)
    fb = tl.minimum(fb, first_bad_row(_ok(ak11, b1, up1), 16, 16))
    fb = tl.minimum(fb, first_bad_row(_ok(ak22, b2, up2), 32, 16))
    fb = tl.minimum(fb, first_bad_row(_ok(ak33, b3, up3), 48, 16))

    aqk_h = aqk + h.to(tl.int64) * T_tot * 64
    _store_blk(aqk_h, tril(aq00, False) * scale, t0, n0, 0, 0)
    _store_blk(aqk_h, aq10 * scale, t0, n0, 1, 0)
    _store_blk(aqk_h, tril(aq11, False) * scale, t0, n0, 1, 1)
    _store_blk(aqk_h, aq20 * scale, t0, n0, 2, 0)
    _store_blk(aqk_h, aq21 * scale, t0, n0, 2, 1)
    _store_blk(aqk_h, tril(aq22, False) * scale, t0, n0, 2, 2)
    _store_blk(aqk_h, aq30 * scale, t0, n0, 3, 0)
    _store_blk(aqk_h, aq31 * scale, t0, n0, 3, 1)
    _store_blk(aqk_h, aq32 * scale, t0, n0, 3, 2)
    _store_blk(aqk_h, tril(aq33, False) * scale, t0, n0, 3, 3)

    if SAVE:  # strictly lower Akk, for beta's score gradient in the backward (its dL * Akk row sums)
        akk_h = akk + h.to(tl.int64) * T_tot * 64
        _store_blk(akk_h, tril(ak00, True), t0, n0, 0, 0)
        _store_blk(akk_h, ak10, t0, n0, 1, 0)
        _store_blk(akk_h, tril(ak11, True), t0, n0, 1, 1)
        _store_blk(akk_h, ak20, t0, n0, 2, 0)
        _store_blk(akk_h, ak21, t0, n0, 2, 1)
        _store_blk(akk_h, tril(ak22, True), t0, n0, 2, 2)
        _store_blk(akk_h, ak30, t0, n0, 3, 0)
        _store_blk(akk_h, ak31, t0, n0, 3, 1)
        _store_blk(akk_h, ak32, t0, n0, 3, 2)
        _store_blk(akk_h, tril(ak33, True), t0, n0, 3, 3)

    # ---- T = (I + L)^{-1}, L = Diag(beta) Akk, block by block ----
    # The diagonal blocks go through a float32 [64, 16] scratch so that the substitution reads their rows back
    # (all rows: beta is zero on rows past the end, so those rows of L are zero).
    ld_c = ldiag + (c * H + h).to(tl.int64) * 1024
    store_tile(ld_c, tril(ak00, True) * b0[:, None], 0, 16, 16, 0, 16, 16, 16)
    store_tile(ld_c, tril(ak11, True) * b1[:, None], 16, 16, 16, 0, 16, 16, 16)
    store_tile(ld_c, tril(ak22, True) * b2[:, None], 32, 16, 16, 0, 16, 16, 16)
    store_tile(ld_c, tril(ak33, True) * b3[:, None], 48, 16, 16, 0, 16, 16, 16)
    tl.debug_barrier()  # rows stored by one thread are read by all
    d0, d1, d2, d3 = inv_unit_lower4(ld_c)
    l10 = ak10 * b1[:, None]
    l20 = ak20 * b2[:, None]
    l21 = ak21 * b2[:, None]
    l30 = ak30 * b3[:, None]
    l31 = ak31 * b3[:, None]
    l32 = ak32 * b3[:, None]
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
    tmat = load_lower(tm_h, t0, n0)
    b = load_rows(beta + h, t0, n0, H, 64)
    r = tl.arange(0, 64)

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

    # ---- W = T Diag(beta) (k 2^G), qg, kg, Gam, per K tile ----
    w_h = w + h.to(tl.int64) * T_tot * K
    qg_h = qg + h.to(tl.int64) * T_tot * K
    kg_h = kg + h.to(tl.int64) * T_tot * K
    rqn = rows_or_one(rq + h, t0, n0, H, L2NORM)  # stored above; visible to every thread after the barrier
    rkn = rows_or_one(rk + h, t0, n0, H, L2NORM)
    if CHECKED:
        good = (r < fb_all)[:, None]  # all true when no row is bad, and then the selects below change no bit
        qnan = tl.where(r < fb_all, 1.0, float("nan"))  # NaN rows by a product, not by a select on the whole tile
    for kk in range(0, K, BKW):
        G = tl.cumsum(load_gate(gh, a_log, dt_bias, h, lower_bound, t0, n0, sk, kk, K, GATE, NARROW, 64, BKW), 0)
        gam = tl.sum(tl.where((r == 63)[:, None], G, 0.0), 0)  # rows past the end have g = 0
        e = tl.exp2(G)
        kn = load_tile(kh, t0, n0, sk, kk, K, 64, BKW) * rkn[:, None]
        qn = load_tile(qh, t0, n0, sk, kk, K, 64, BKW) * rqn[:, None]
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
        cols = kk + tl.arange(0, BKW)
        if CHECKED:
            gam = tl.where(fb_all < 64, float("nan"), gam)  # rows past the end are never bad: 64 means none
        tl.store(glast + (c * H + h).to(tl.int64) * K + cols, gam, mask=cols < K)
    return needs_check


# Two pipeline stages issue the next K tile's loads before this one's dots; two warps win at K = V = 64 and lose at
# 128, so both warp counts are tuned.
@autotune([{}, {}, {}], [(4, 2), (4, 1), (2, 1)], ["K", "V", "GATE", "NARROW", "L2NORM", "SAVE"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _prep_kernel(
    q, k, v, g, beta, a_log, dt_bias,  # inputs [T_total, H, *] (beta [T_total, H]); a_log [H], dt_bias [H, K]
    w, u, qg, kg, aqk, tm, glast, rq, rk, akk,  # outputs (see the module docstring)
    ldiag,  # float32 scratch [chunks, H, 64, 16]: the diagonal blocks of L
    redo,  # int8 [chunks, H]: 1 where the chunk needs the checked path
    cu, chunk_seq, chunk_tok,
    scale, lower_bound, T, NT, T_tot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKA: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, GATE: tl.constexpr, NARROW: tl.constexpr, L2NORM: tl.constexpr, SAVE: tl.constexpr,
    IO: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """The plain path for every chunk, one program per (chunk, head), and the flag that sends it to the checked
    path."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:  # a spare grid slot (varlen)
        tl.store(redo + c * H + h, tl.zeros([], dtype=tl.int8))
        return
    bad = _prep_chunk(
        c, h, t0, eos, q, k, v, g, beta, a_log, dt_bias, w, u, qg, kg, aqk, tm, glast, rq, rk, akk, ldiag, scale,
        lower_bound, T_tot, H, K, V, BKA, BKW, BV, GATE, NARROW, L2NORM, SAVE, IO, ADT, PREC, EMU, CHECKED=False,
    )  # fmt: skip
    tl.store(redo + c * H + h, bad.to(tl.int8))


@triton.jit(do_not_specialize=["T", "NT", "T_tot", "n_flags"])
def _prep_redo_kernel(
    q, k, v, g, beta, a_log, dt_bias, w, u, qg, kg, aqk, tm, glast, rq, rk, akk, ldiag, redo,
    cu, chunk_seq, chunk_tok,
    scale, lower_bound, T, NT, T_tot, n_flags,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKA: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, GATE: tl.constexpr, NARROW: tl.constexpr, L2NORM: tl.constexpr, SAVE: tl.constexpr,
    IO: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, FLAGS: tl.constexpr,
):  # fmt: skip
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
                        c, h, t0, eos, q, k, v, g, beta, a_log, dt_bias, w, u, qg, kg, aqk, tm, glast, rq, rk,
                        akk, ldiag, scale, lower_bound, T_tot, H, K, V, BKA, BKW, BV, GATE, NARROW, L2NORM, SAVE,
                        IO, ADT, PREC, EMU, CHECKED=True,
                    )  # fmt: skip
