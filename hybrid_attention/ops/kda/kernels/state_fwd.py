"""KDA chunk forward, stage 2: the state walk, one program per (V tile, sequence, head) over the sequence's chunks in
order, the state in float32 registers (docs/kernels.md, "Stages").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    chunk_decay,
    load_lower,
    load_raw,
    load_state,
    load_tile,
    mm,
    seq_info,
    state_slice,
    store_state,
    store_tile,
)
from hybrid_attention.ops.triton_support import autotune


# Wide V tiles with few stages suit many (sequence, head) pairs; with few pairs the pass is as long as one program's
# walk and narrow tiles with deeper pipelining (loads two chunks ahead) win.
# WIDTH (the pairs, bucketed) is in the key so each regime tunes apart.
@autotune(
    [{"BV": 64}, {"BV": 128}, {"BV": 32}, {"BV": 16}, {"BV": 32}, {"BV": 16}, {"BV": 16}],
    [(4, 1), (8, 2), (4, 1), (4, 2), (4, 2), (4, 3), (8, 3)],
    ["K", "V", "SAVE", "OUT", "HAS_H0", "STORE_HT", "WIDTH"],
)
@triton.jit(do_not_specialize=["T", "NT", "T_tot", "WIDTH"])
def _state_fwd_kernel(
    w,
    u,
    qg,
    kg,
    aqk,
    glast,
    h0,  # prep outputs; h0 [N, H, K, V] float32
    o,
    ht,
    hbuf,
    vnew,  # o [T_total, H, V]; ht [N, H, K, V] f32; hbuf [chunks, H, K, V]; vnew [H, T_total, V]
    cu,
    chunk_off,
    T,
    NT,
    T_tot,
    WIDTH,  # WIDTH: autotuning key only (see above)
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    SAVE: tl.constexpr,
    OUT: tl.constexpr,
    IO: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """Walk the chunks of one (V tile, sequence, head) in order: D = U - W S, O = qg S + Aqk D,
    S <- Diag(2^Gam) S + kg^T D. Head-major W, qg, kg [H, T_total, K], U [H, T_total, V], Aqk [H, T_total, 64]."""
    # SAVE: store S per chunk and D (the backward, or the output pass, reads them); OUT: compute O here.
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos, eos, c0 = seq_info(n, cu, chunk_off, T, NT, VARLEN)
    soffs, smask = state_slice(iv, K, V, BK, BV)
    S = load_state(h0, n * H + h, soffs, smask, HAS_H0, K, V, BK, BV)
    w_h = w + h.to(tl.int64) * T_tot * K
    qg_h = qg + h.to(tl.int64) * T_tot * K
    kg_h = kg + h.to(tl.int64) * T_tot * K
    u_h = u + h.to(tl.int64) * T_tot * V
    vn_h = vnew + h.to(tl.int64) * T_tot * V
    a_h = aqk + h.to(tl.int64) * T_tot * 64
    for j in range(0, tl.cdiv(eos - bos, 64)):
        t0 = bos + j * 64
        nv = eos - t0
        cj = c0 + j
        if SAVE:
            store_state(hbuf, cj * H + h, S, soffs, smask, K, V)
        Wt = load_raw(w_h, t0, nv, K, 0, K, 64, BK)
        D = load_tile(u_h, t0, nv, V, iv * BV, V, 64, BV) - mm(Wt, S, IO, PREC, EMU)
        if SAVE:
            store_tile(vn_h, D, t0, nv, V, iv * BV, V, 64, BV)
        if OUT:
            Qt = load_raw(qg_h, t0, nv, K, 0, K, 64, BK)
            At = load_lower(a_h, t0, nv)
            O = mm(Qt, S, IO, PREC, EMU) + mm(At, D, IO, PREC, EMU)
            store_tile(o + h * V, O, t0, nv, H * V, iv * BV, V, 64, BV)
        Kt = load_raw(kg_h, t0, nv, K, 0, K, 64, BK)
        S = S * tl.exp2(chunk_decay(glast, cj, h, H, K, BK))[:, None] + mm(tl.trans(Kt), D, IO, PREC, EMU)
    if STORE_HT:
        store_state(ht, n * H + h, S, soffs, smask, K, V)
