"""KDA chunk backward, stage 2: the per-chunk score gradients (dv, dAqk, Diag(beta) dL and beta's parts), one program
per (chunk, head); docs/kernels.md, "The backward through the inverse collapses".
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    chunk_info,
    load_lower,
    load_raw,
    load_rows,
    load_tile,
    mm,
    store_rows,
    store_tile,
)
from hybrid_attention.ops.triton_support import autotune


# The V tile is fixed (reduction_tile) and only warps and stages are tuned: the sums over V then run in one order
# whatever the tuner picks, so the backward is bitwise repeatable from run to run. Pipelined loads beat one stage.
@autotune([{}, {}], [(4, 3), (4, 2)], ["V"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _score_grad_kernel(
    do,
    vnew,
    dvnew,
    v,
    beta,
    tm,
    akk,  # dO, v [T_total, H, V]; D, dD [H, T_total, V]; beta [T_total, H]; T, Akk
    dv,
    dbeta,
    daq,
    dak,  # dv [T_total, H, V]; dbeta [T_total, H] f32; dAqk, dAkk [H, T_total, 64] (ADT)
    cu,
    chunk_seq,
    chunk_tok,
    scale,
    T,
    NT,
    T_tot,
    H: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    IO: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """One (chunk, head): R = T^T dD, dv = beta R, dAqk = dO D^T, dM = -R D^T (M = I + Diag(beta) Akk), and beta's
    parts rowsum(R * v) and rowsum(dL * Akk), dL the strictly lower part of dM. T, Akk [H, T_total, 64]."""
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
