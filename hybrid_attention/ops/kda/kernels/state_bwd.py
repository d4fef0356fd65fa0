"""KDA chunk backward, stage 1: the reverse state walk, one program per (V tile, sequence, head) over the sequence's
chunks in reverse (docs/kernels.md, "Stages").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    chunk_decay,
    load_lower,
    load_raw,
    load_state,
    mm,
    seq_info,
    state_slice,
    store_state,
    store_tile,
)
from hybrid_attention.ops.triton_support import autotune


# With 4 warps and 2 pipeline stages this kernel miscomputes on an H200 with triton 3.6 (BV 16: dh0 off by 6e-2 at
# K = V = 128; BV 32: an illegal address at K = V = 64), so no such config is offered;
# tests/gpu/ops/kda/test_triton_gpu.py::test_every_autotune_config runs each config here alone against the reference.
@autotune([{"BV": 32}, {"BV": 64}], [(4, 1), (8, 2)], ["K", "V", "HAS_DHT", "HAS_H0", "WIDTH"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot", "WIDTH"])
def _state_bwd_kernel(
    qg,
    kg,
    w,
    aqk,
    glast,
    do,
    dht,  # saved prep outputs, dO [T_total, H, V], dht [N, H, K, V] f32
    dh0,
    dhbuf,
    dvnew,  # dh0 [N, H, K, V] f32, dhbuf [chunks, H, K, V] (dS1 per chunk), dvnew [H, T_total, V]
    cu,
    chunk_off,
    T,
    NT,
    T_tot,
    WIDTH,  # WIDTH: autotuning key only
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_H0: tl.constexpr,
    IO: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """Walk the chunks of one (V tile, sequence, head) in reverse: dD = Aqk^T dO + kg dS1,
    dS0 = Diag(2^Gam) dS1 + qg^T dO - W^T dD. qg, kg, W [H, T_total, K]; Aqk [H, T_total, 64]; Gam [chunks, H, K]."""
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
