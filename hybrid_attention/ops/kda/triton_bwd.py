"""KDA backward, stages 1 and 2 of 3: the reverse state pass and the per-chunk score gradients.

Per chunk (forward: D = U - W S0, O = qg S0 + Aqk D, S1 = Diag(2^Gam) S0 + kg^T D), with dS1 the gradient of the
state at the chunk's end:

    dD  = Aqk^T dO + kg dS1                               (stage 1, sequential, reverse over chunks)
    dS0 = Diag(2^Gam) dS1 + qg^T dO - W^T dD              (stage 1; dS0 of the first chunk is d initial_state)
    R   = T^T dD      dv = beta * R                        (stage 2, parallel over chunks)
    dAqk = dO D^T      dM = -R D^T                         (stage 2; dM is the gradient of M = I + Diag(beta) Akk)

The last line uses D = T Diag(beta) (V - K~ S0): since W and U enter only through D, the gradient of the
inverse collapses from -T^T dT T^T to -R D^T (docs/kernels.md has the derivation). Stage 1 stores dS1 per
chunk and dD; stage 2 stores dv, beta's v-part of the gradient and the two score gradients for stage 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    autotune,
    chunk_info,
    empty,
    load_lower,
    load_raw,
    load_rows,
    load_tile,
    mm,
    seq_info,
    store_tile,
    tril,
)


@autotune([{"BV": 32}, {"BV": 64}, {"BV": 32}], [(4, 1), (8, 2), (4, 2)], ["K", "V", "HAS_DHT", "HAS_H0"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _state_bwd_kernel(
    qg, kg, w, aqk, glast, do, dht,  # saved prep outputs, dO [T_total, H, V], dht [N, H, K, V] f32
    dh0, dhbuf, dvnew,  # dh0 [N, H, K, V] f32, dhbuf [chunks, H, K, V] (dS1 per chunk), dvnew [H, T_total, V]
    cu, chunk_off, T, NT, T_tot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos, eos, c0 = seq_info(n, cu, chunk_off, T, NT, VARLEN)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    smask = (rk < K)[:, None] & (rv < V)[None, :]
    soffs = rk[:, None] * V + rv[None, :]
    if HAS_DHT:
        dS = tl.load(dht + (n * H + h).to(tl.int64) * K * V + soffs, mask=smask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    w_h = w + h.to(tl.int64) * T_tot * K
    qg_h = qg + h.to(tl.int64) * T_tot * K
    kg_h = kg + h.to(tl.int64) * T_tot * K
    a_h = aqk + h.to(tl.int64) * T_tot * 64
    dvn_h = dvnew + h.to(tl.int64) * T_tot * V
    nc = tl.cdiv(eos - bos, 64)
    for jj in range(0, nc):
        j = nc - 1 - jj
        t0 = bos + j * 64
        nv = eos - t0
        cj = c0 + j
        tl.store(dhbuf + (cj * H + h).to(tl.int64) * K * V + soffs, dS.to(IO), mask=smask)
        dO = load_raw(do + h * V, t0, nv, H * V, iv * BV, V, 64, BV)
        At = load_lower(a_h, t0, nv)
        Kt = load_raw(kg_h, t0, nv, K, 0, K, 64, BK)
        dD = mm(tl.trans(At), dO, IO, PREC, EMU) + mm(Kt, dS, IO, PREC, EMU)
        store_tile(dvn_h, dD, t0, nv, V, iv * BV, V, 64, BV)
        Qt = load_raw(qg_h, t0, nv, K, 0, K, 64, BK)
        Wt = load_raw(w_h, t0, nv, K, 0, K, 64, BK)
        gam = tl.load(glast + (cj * H + h).to(tl.int64) * K + rk, mask=rk < K, other=0.0)
        dS = dS * tl.exp2(gam)[:, None] + mm(tl.trans(Qt), dO, IO, PREC, EMU) - mm(tl.trans(Wt), dD, IO, PREC, EMU)
    if HAS_H0:
        tl.store(dh0 + (n * H + h).to(tl.int64) * K * V + soffs, dS, mask=smask)


@triton.jit
def _load_blk(ptr, t0, nv, A: tl.constexpr, B: tl.constexpr):
    """Block (A, B) of a chunk's [64, 64] matrix from its [rows, 64] storage (stored dtype)."""
    return load_raw(ptr, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)


@triton.jit
def _store_blk(ptr, x, t0, nv, A: tl.constexpr, B: tl.constexpr):
    store_tile(ptr, x, t0 + 16 * A, nv - 16 * A, 64, 16 * B, 64, 16, 16)


@triton.jit
def _dn(x, y, IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """x @ y^T for [16, BV] tiles: one 16 x 16 block of a score gradient."""
    return mm(x, tl.trans(y), IO, PREC, EMU)


@triton.jit
def _tt(t, x, IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """t^T @ x for a 16 x 16 block t of T."""
    return mm(tl.trans(t), x, IO, PREC, EMU)


@autotune([{"BV": 32}, {"BV": 64}], [(4, 1), (8, 1)], ["V"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _score_grad_kernel(
    do, vnew, dvnew, v, beta, tm,  # dO, v [T_total, H, V]; D, dD [H, T_total, V]; beta [T_total, H]; T
    dv, dbeta, daq, dl,  # dv [T_total, H, V]; dbeta [T_total, H] f32 (v-part); dAqk, dL [H, T_total, 64] f32
    cu, chunk_seq, chunk_tok, scale, T, NT, T_tot,
    H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:
        return
    n0 = eos - t0
    n1 = n0 - 16
    n2 = n0 - 32
    n3 = n0 - 48
    tm_h = tm + h.to(tl.int64) * T_tot * 64
    t00 = _load_blk(tm_h, t0, n0, 0, 0)
    t10 = _load_blk(tm_h, t0, n0, 1, 0)
    t11 = _load_blk(tm_h, t0, n0, 1, 1)
    t20 = _load_blk(tm_h, t0, n0, 2, 0)
    t21 = _load_blk(tm_h, t0, n0, 2, 1)
    t22 = _load_blk(tm_h, t0, n0, 2, 2)
    t30 = _load_blk(tm_h, t0, n0, 3, 0)
    t31 = _load_blk(tm_h, t0, n0, 3, 1)
    t32 = _load_blk(tm_h, t0, n0, 3, 2)
    t33 = _load_blk(tm_h, t0, n0, 3, 3)
    b0 = load_rows(beta + h, t0, n0, H, 16)
    b1 = load_rows(beta + h, t0 + 16, n1, H, 16)
    b2 = load_rows(beta + h, t0 + 32, n2, H, 16)
    b3 = load_rows(beta + h, t0 + 48, n3, H, 16)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    q00 = zero
    q10 = zero
    q11 = zero
    q20 = zero
    q21 = zero
    q22 = zero
    q30 = zero
    q31 = zero
    q32 = zero
    q33 = zero
    m00 = zero
    m10 = zero
    m11 = zero
    m20 = zero
    m21 = zero
    m22 = zero
    m30 = zero
    m31 = zero
    m32 = zero
    m33 = zero
    zv = tl.zeros([16], dtype=tl.float32)
    s0 = zv
    s1 = zv
    s2 = zv
    s3 = zv
    vn_h = vnew + h.to(tl.int64) * T_tot * V
    dvn_h = dvnew + h.to(tl.int64) * T_tot * V
    for vv in range(0, V, BV):
        o0 = load_raw(do + h * V, t0, n0, H * V, vv, V, 16, BV)
        o1 = load_raw(do + h * V, t0 + 16, n1, H * V, vv, V, 16, BV)
        o2 = load_raw(do + h * V, t0 + 32, n2, H * V, vv, V, 16, BV)
        o3 = load_raw(do + h * V, t0 + 48, n3, H * V, vv, V, 16, BV)
        x0 = load_raw(vn_h, t0, n0, V, vv, V, 16, BV)
        x1 = load_raw(vn_h, t0 + 16, n1, V, vv, V, 16, BV)
        x2 = load_raw(vn_h, t0 + 32, n2, V, vv, V, 16, BV)
        x3 = load_raw(vn_h, t0 + 48, n3, V, vv, V, 16, BV)
        y0 = load_raw(dvn_h, t0, n0, V, vv, V, 16, BV)
        y1 = load_raw(dvn_h, t0 + 16, n1, V, vv, V, 16, BV)
        y2 = load_raw(dvn_h, t0 + 32, n2, V, vv, V, 16, BV)
        y3 = load_raw(dvn_h, t0 + 48, n3, V, vv, V, 16, BV)
        # R_b = sum_{a >= b} T_ab^T dD_a
        r0 = _tt(t00, y0, IO, PREC, EMU) + _tt(t10, y1, IO, PREC, EMU) + _tt(t20, y2, IO, PREC, EMU)
        r0 += _tt(t30, y3, IO, PREC, EMU)
        r1 = _tt(t11, y1, IO, PREC, EMU) + _tt(t21, y2, IO, PREC, EMU) + _tt(t31, y3, IO, PREC, EMU)
        r2 = _tt(t22, y2, IO, PREC, EMU) + _tt(t32, y3, IO, PREC, EMU)
        r3 = _tt(t33, y3, IO, PREC, EMU)
        store_tile(dv + h * V, r0 * b0[:, None], t0, n0, H * V, vv, V, 16, BV)
        store_tile(dv + h * V, r1 * b1[:, None], t0 + 16, n1, H * V, vv, V, 16, BV)
        store_tile(dv + h * V, r2 * b2[:, None], t0 + 32, n2, H * V, vv, V, 16, BV)
        store_tile(dv + h * V, r3 * b3[:, None], t0 + 48, n3, H * V, vv, V, 16, BV)
        s0 += tl.sum(r0 * load_tile(v + h * V, t0, n0, H * V, vv, V, 16, BV), 1)
        s1 += tl.sum(r1 * load_tile(v + h * V, t0 + 16, n1, H * V, vv, V, 16, BV), 1)
        s2 += tl.sum(r2 * load_tile(v + h * V, t0 + 32, n2, H * V, vv, V, 16, BV), 1)
        s3 += tl.sum(r3 * load_tile(v + h * V, t0 + 48, n3, H * V, vv, V, 16, BV), 1)
        q00 += _dn(o0, x0, IO, PREC, EMU)
        q10 += _dn(o1, x0, IO, PREC, EMU)
        q11 += _dn(o1, x1, IO, PREC, EMU)
        q20 += _dn(o2, x0, IO, PREC, EMU)
        q21 += _dn(o2, x1, IO, PREC, EMU)
        q22 += _dn(o2, x2, IO, PREC, EMU)
        q30 += _dn(o3, x0, IO, PREC, EMU)
        q31 += _dn(o3, x1, IO, PREC, EMU)
        q32 += _dn(o3, x2, IO, PREC, EMU)
        q33 += _dn(o3, x3, IO, PREC, EMU)
        m00 += _dn(r0, x0, IO, PREC, EMU)
        m10 += _dn(r1, x0, IO, PREC, EMU)
        m11 += _dn(r1, x1, IO, PREC, EMU)
        m20 += _dn(r2, x0, IO, PREC, EMU)
        m21 += _dn(r2, x1, IO, PREC, EMU)
        m22 += _dn(r2, x2, IO, PREC, EMU)
        m30 += _dn(r3, x0, IO, PREC, EMU)
        m31 += _dn(r3, x1, IO, PREC, EMU)
        m32 += _dn(r3, x2, IO, PREC, EMU)
        m33 += _dn(r3, x3, IO, PREC, EMU)
    r16 = tl.arange(0, 16)
    tl.store(dbeta + (t0 + r16) * H + h, s0, mask=r16 < n0)
    tl.store(dbeta + (t0 + 16 + r16) * H + h, s1, mask=r16 < n1)
    tl.store(dbeta + (t0 + 32 + r16) * H + h, s2, mask=r16 < n2)
    tl.store(dbeta + (t0 + 48 + r16) * H + h, s3, mask=r16 < n3)
    daq_h = daq + h.to(tl.int64) * T_tot * 64
    _store_blk(daq_h, tril(q00, False) * scale, t0, n0, 0, 0)
    _store_blk(daq_h, q10 * scale, t0, n0, 1, 0)
    _store_blk(daq_h, tril(q11, False) * scale, t0, n0, 1, 1)
    _store_blk(daq_h, q20 * scale, t0, n0, 2, 0)
    _store_blk(daq_h, q21 * scale, t0, n0, 2, 1)
    _store_blk(daq_h, tril(q22, False) * scale, t0, n0, 2, 2)
    _store_blk(daq_h, q30 * scale, t0, n0, 3, 0)
    _store_blk(daq_h, q31 * scale, t0, n0, 3, 1)
    _store_blk(daq_h, q32 * scale, t0, n0, 3, 2)
    _store_blk(daq_h, tril(q33, False) * scale, t0, n0, 3, 3)
    dl_h = dl + h.to(tl.int64) * T_tot * 64
    _store_blk(dl_h, -tril(m00, True), t0, n0, 0, 0)
    _store_blk(dl_h, -m10, t0, n0, 1, 0)
    _store_blk(dl_h, -tril(m11, True), t0, n0, 1, 1)
    _store_blk(dl_h, -m20, t0, n0, 2, 0)
    _store_blk(dl_h, -m21, t0, n0, 2, 1)
    _store_blk(dl_h, -tril(m22, True), t0, n0, 2, 2)
    _store_blk(dl_h, -m30, t0, n0, 3, 0)
    _store_blk(dl_h, -m31, t0, n0, 3, 1)
    _store_blk(dl_h, -m32, t0, n0, 3, 2)
    _store_blk(dl_h, -tril(m33, True), t0, n0, 3, 3)


def state_bwd(saved, do, dht, h0_needed, layout, *, K, V, dtypes):
    """Stage 1: returns (dh0 [N, H, K, V] f32 or empty, dS1 per chunk [chunks, H, K, V], dD [H, T_total, V])."""
    IO, _, PREC, EMU = dtypes
    T_tot, H, _ = do.shape
    N = layout.n_seq
    f32 = torch.float32
    none = empty(do, 0, dtype=f32)
    dh0 = empty(do, N, H, K, V, dtype=f32) if h0_needed else none
    dhbuf = empty(do, layout.n_chunks, H, K, V)
    dvnew = empty(do, H, T_tot, V)
    cu, _, _, chunk_off, T, NT = layout.args()
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N, H)
    _state_bwd_kernel[grid](
        saved["qg"], saved["kg"], saved["w"], saved["aqk"], saved["glast"], do, dht if dht is not None else none,
        dh0, dhbuf, dvnew,
        cu, chunk_off, T, NT, T_tot,
        H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), VARLEN=layout.varlen, HAS_DHT=dht is not None,
        HAS_H0=h0_needed, IO=IO, PREC=PREC, EMU=EMU,
    )  # fmt: skip
    return dh0, dhbuf, dvnew


def score_grad(saved, do, dvnew, v, beta, dbeta_v, layout, *, scale, dtypes):
    """Stage 2: returns (dv [T_total, H, V] in v.dtype, dAqk and dL [H, T_total, 64] float32); writes the
    v-part of d beta into dbeta_v [T_total, H] float32."""
    IO, _, PREC, EMU = dtypes
    T_tot, H, V = v.shape
    dv = empty(v, *v.shape)
    daq = empty(v, H, T_tot, 64, dtype=torch.float32)
    dl = empty(v, H, T_tot, 64, dtype=torch.float32)
    cu, chunk_seq, chunk_tok, _, T, NT = layout.args()
    _score_grad_kernel[(layout.n_chunks, H)](
        do, saved["vnew"], dvnew, v, beta, saved["tm"],
        dv, dbeta_v, daq, dl,
        cu, chunk_seq, chunk_tok, scale, T, NT, T_tot,
        H=H, V=V, VARLEN=layout.varlen, IO=IO, PREC=PREC, EMU=EMU,
    )  # fmt: skip
    return dv, daq, dl
