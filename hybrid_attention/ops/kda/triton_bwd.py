"""KDA backward, stages 1 and 2 of 3: the reverse state pass and the per-chunk score gradients.

Per chunk (forward: D = U - W S0, O = qg S0 + Aqk D, S1 = Diag(2^Gam) S0 + kg^T D), with dS1 the gradient of the
state at the chunk's end:

    dD  = Aqk^T dO + kg dS1                               (stage 1, sequential, reverse over chunks)
    dS0 = Diag(2^Gam) dS1 + qg^T dO - W^T dD              (stage 1; dS0 of the first chunk is d initial_state)
    R   = T^T dD      dv = beta * R                        (stage 2, parallel over chunks)
    dAqk = dO D^T      dM = -R D^T                         (stage 2; dM is the gradient of M = I + Diag(beta) Akk)

The last line uses D = T Diag(beta) (V - K~ S0): since W and U enter only through D, the gradient of the
inverse collapses from -T^T dT T^T to -R D^T (docs/kernels.md has the derivation). Stage 1 stores dS1 per
chunk and dD; stage 2 stores dv, beta's parts of the gradient from v and from M (rowsum(dL * Akk), dL = the
strictly lower part of dM, with the Akk the forward saved) and the score gradients dAqk, Diag(beta) dL for stage 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    autotune,
    chunk_decay,
    chunk_info,
    empty,
    load_lower,
    load_raw,
    load_rows,
    load_state,
    load_tile,
    mm,
    seq_info,
    state_slice,
    store_rows,
    store_state,
    store_tile,
    tuning_width,
)


# With 4 warps and 2 pipeline stages this kernel miscomputes on an H200 with triton 3.6 (BV 16: dh0 off by 6e-2 at
# K = V = 128; BV 32: an illegal address at K = V = 64), so no such config is offered;
# tests/gpu/test_kda_triton.py::test_every_autotune_config runs each config here alone against the reference.
@autotune([{"BV": 32}, {"BV": 64}], [(4, 1), (8, 2)], ["K", "V", "HAS_DHT", "HAS_H0", "WIDTH"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot", "WIDTH"])
def _state_bwd_kernel(
    qg, kg, w, aqk, glast, do, dht,  # saved prep outputs, dO [T_total, H, V], dht [N, H, K, V] f32
    dh0, dhbuf, dvnew,  # dh0 [N, H, K, V] f32, dhbuf [chunks, H, K, V] (dS1 per chunk), dvnew [H, T_total, V]
    cu, chunk_off, T, NT, T_tot, WIDTH,  # WIDTH: autotuning key only
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos, eos, c0 = seq_info(n, cu, chunk_off, T, NT, VARLEN)
    soffs, smask = state_slice(iv, K, V, BK, BV)
    dS = load_state(dht, n * H + h, soffs, smask, HAS_DHT, K, V, BK, BV)
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
        store_state(dhbuf, cj * H + h, dS, soffs, smask, K, V)
        dO = load_raw(do + h * V, t0, nv, H * V, iv * BV, V, 64, BV)
        At = load_lower(a_h, t0, nv)
        Kt = load_raw(kg_h, t0, nv, K, 0, K, 64, BK)
        dD = mm(tl.trans(At), dO, IO, PREC, EMU) + mm(Kt, dS, IO, PREC, EMU)
        store_tile(dvn_h, dD, t0, nv, V, iv * BV, V, 64, BV)
        Qt = load_raw(qg_h, t0, nv, K, 0, K, 64, BK)
        Wt = load_raw(w_h, t0, nv, K, 0, K, 64, BK)
        decay = tl.exp2(chunk_decay(glast, cj, h, H, K, BK))
        dS = dS * decay[:, None] + mm(tl.trans(Qt), dO, IO, PREC, EMU) - mm(tl.trans(Wt), dD, IO, PREC, EMU)
    if HAS_H0:
        store_state(dh0, n * H + h, dS, soffs, smask, K, V)


# The V tile is fixed (reduction_tile) and only warps and stages are tuned: the sums over V then run in one order
# whatever the tuner picks, so the backward is bitwise repeatable from run to run. Pipelined loads beat one stage.
@autotune([{}, {}], [(4, 3), (4, 2)], ["V"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _score_grad_kernel(
    do, vnew, dvnew, v, beta, tm, akk,  # dO, v [T_total, H, V]; D, dD [H, T_total, V]; beta [T_total, H]; T, Akk
    dv, dbeta, daq, dak,  # dv [T_total, H, V]; dbeta [T_total, H] f32; dAqk, dAkk [H, T_total, 64] (ADT)
    cu, chunk_seq, chunk_tok, scale, T, NT, T_tot,
    H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:
        return
    nv = eos - t0
    tmat = load_lower(tm + h.to(tl.int64) * T_tot * 64, t0, nv)
    b = load_rows(beta + h, t0, nv, H, 64)
    daq_acc = tl.zeros([64, 64], dtype=tl.float32)
    dm_acc = tl.zeros([64, 64], dtype=tl.float32)
    dbv = tl.zeros([64], dtype=tl.float32)
    vn_h = vnew + h.to(tl.int64) * T_tot * V
    dvn_h = dvnew + h.to(tl.int64) * T_tot * V
    for vv in range(0, V, BV):
        dO = load_raw(do + h * V, t0, nv, H * V, vv, V, 64, BV)
        D = load_raw(vn_h, t0, nv, V, vv, V, 64, BV)
        R = mm(tl.trans(tmat), load_raw(dvn_h, t0, nv, V, vv, V, 64, BV), IO, PREC, EMU)  # R = T^T dD
        store_tile(dv + h * V, R * b[:, None], t0, nv, H * V, vv, V, 64, BV)
        dbv += tl.sum(R * load_tile(v + h * V, t0, nv, H * V, vv, V, 64, BV), 1)
        daq_acc += mm(dO, tl.trans(D), IO, PREC, EMU)
        dm_acc += mm(R, tl.trans(D), IO, PREC, EMU)
    # The scores are causal inside the chunk: Aqk keeps the diagonal, Akk (through dL = -(R D^T)) does not.
    # Entries above are stored as zeros (the readers mask the upper 16 x 16 blocks anyway).
    r = tl.arange(0, 64)
    dL = tl.where(r[:, None] > r[None, :], -dm_acc, 0.0)
    # beta's parts from v (above) and from L = Diag(beta) Akk: d beta_t += sum_i dL[t, i] Akk[t, i]
    dbv += tl.sum(dL * load_lower(akk + h.to(tl.int64) * T_tot * 64, t0, nv), 1)
    store_rows(dbeta + h, dbv, t0, nv, H, 64)
    # The q/k/g kernel multiplies dAqk and dAkk = Diag(beta) dL as dot operands: stored in that dtype.
    below = r[:, None] >= r[None, :]
    daq_h = daq + h.to(tl.int64) * T_tot * 64
    store_tile(daq_h, tl.where(below, daq_acc * scale, 0.0), t0, nv, 64, 0, 64, 64, 64)
    store_tile(dak + h.to(tl.int64) * T_tot * 64, dL * b[:, None], t0, nv, 64, 0, 64, 64, 64)


def reduction_tile(V: int) -> int:
    """The V tile of the kernels that sum over V (score gradients, dq/dk/dg): a function of V alone."""
    return min(64, max(16, triton.next_power_of_2(V)))


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
        cu, chunk_off, T, NT, T_tot, tuning_width(N * H),
        H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), VARLEN=layout.varlen, HAS_DHT=dht is not None,
        HAS_H0=h0_needed, IO=IO, PREC=PREC, EMU=EMU,
    )  # fmt: skip
    return dh0, dhbuf, dvnew


def score_grad(saved, do, dvnew, v, beta, dbeta_v, layout, *, scale, dtypes):
    """Stage 2: returns (dv [T_total, H, V] in v.dtype, dAqk and dAkk = Diag(beta) dL [H, T_total, 64] in the
    score dots' dtype); writes d beta's parts from v and from Akk into dbeta_v [T_total, H] float32."""
    IO, ADT, PREC, EMU = dtypes
    T_tot, H, V = v.shape
    dv = empty(v, *v.shape)
    adt = torch.float32 if ADT == tl.float32 else v.dtype  # ADT is float32 or the io dtype
    daq = empty(v, H, T_tot, 64, dtype=adt)
    dak = empty(v, H, T_tot, 64, dtype=adt)
    cu, chunk_seq, chunk_tok, _, T, NT = layout.args()
    _score_grad_kernel[(layout.n_chunks, H)](
        do, saved["vnew"], dvnew, v, beta, saved["tm"], saved["akk"],
        dv, dbeta_v, daq, dak,
        cu, chunk_seq, chunk_tok, scale, T, NT, T_tot,
        H=H, V=V, BV=reduction_tile(V), VARLEN=layout.varlen, IO=IO, PREC=PREC, EMU=EMU,
    )  # fmt: skip
    return dv, daq, dak
