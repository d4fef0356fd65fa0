"""KDA chunk forward, stage 3 (optional): the output pass, O = qg S + Aqk D for every chunk in parallel, for few long
sequences (docs/kernels.md, "Long sequences").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import chunk_info, load_lower, load_raw, mm, store_tile
from hybrid_attention.ops.triton_support import autotune


@autotune([{"BV": 64}, {"BV": 128}], [(4, 2), (8, 2)], ["K", "V"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _output_kernel(
    qg,
    aqk,
    hbuf,
    vnew,
    o,  # qg [H, T_total, K], Aqk [H, T_total, 64], S [chunks, H, K, V], D [H, T_total, V]
    cu,
    chunk_seq,
    chunk_tok,
    T,
    NT,
    T_tot,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    IO: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    """O = qg S + Aqk D for one (chunk, head, V tile), from the S and D that the walk stored."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    seq, t0, eos = chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN)
    if seq < 0:
        return
    nv = eos - t0
    S = load_raw(hbuf + (c * H + h).to(tl.int64) * K * V, 0, K, V, iv * BV, V, BK, BV)
    Qt = load_raw(qg + h.to(tl.int64) * T_tot * K, t0, nv, K, 0, K, 64, BK)
    At = load_lower(aqk + h.to(tl.int64) * T_tot * 64, t0, nv)
    D = load_raw(vnew + h.to(tl.int64) * T_tot * V, t0, nv, V, iv * BV, V, 64, BV)
    O = mm(Qt, S, IO, PREC, EMU) + mm(At, D, IO, PREC, EMU)
    store_tile(o + h * V, O, t0, nv, H * V, iv * BV, V, 64, BV)
