"""KDA forward, stage 2: the state pass (and, for few long sequences, a separate output pass), and the host
function that runs the stages.

One program per (V tile, sequence, head) walks the sequence's chunks in order, keeping the [K, BV] state S in
float32 registers (docs/math.md, "Chunkwise form", with the prep outputs of triton_prep.py):

    D = U - W S          O = qg S + Aqk D          S <- Diag(2^Gam) S + kg^T D

For the backward it also stores S at the start of every chunk (`h`) and D (`v_new`); inference skips both.
Everything chunk-local was done by the parallel prep kernel, so this pass is four dots per chunk.

The walk is as long as one program's: with few (sequence, head) pairs (one 64K-token sequence of 16 heads) it
takes most of the forward, and O is about half of every step. With
`split_output`, the walk leaves O out and stores S and D, and `_output_kernel` computes O for every chunk in
parallel. Both ways multiply the same rounded operands (the dots round S and D to the io dtype, the stores too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_prep import prep_fwd
from hybrid_attention.ops.kda.triton_utils import (
    ChunkLayout,
    autotune,
    chunk_decay,
    chunk_info,
    dot_setup,
    empty,
    load_lower,
    load_raw,
    load_state,
    load_tile,
    mm,
    seq_info,
    state_slice,
    store_state,
    store_tile,
    tuning_width,
)


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
    w, u, qg, kg, aqk, glast, h0,  # prep outputs; h0 [N, H, K, V] float32
    o, ht, hbuf, vnew,  # o [T_total, H, V]; ht [N, H, K, V] f32; hbuf [chunks, H, K, V]; vnew [H, T_total, V]
    cu, chunk_off, T, NT, T_tot, WIDTH,  # WIDTH: autotuning key only (see above)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE: tl.constexpr, OUT: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
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


@autotune([{"BV": 64}, {"BV": 128}], [(4, 2), (8, 2)], ["K", "V"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot"])
def _output_kernel(
    qg, aqk, hbuf, vnew, o,  # qg [H, T_total, K], Aqk [H, T_total, 64], S [chunks, H, K, V], D [H, T_total, V]
    cu, chunk_seq, chunk_tok, T, NT, T_tot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
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


def split_output(pairs: int) -> bool:
    """Whether the forward computes O in the separate output pass: for at most 32 (sequence, head) pairs, where the
    walk is long and its programs few; with more pairs the walk's programs already fill the GPU."""
    return tuning_width(pairs) <= 32


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def allocate_fwd(q, v, n_seq, n_chunks, *, final, save, l2norm):
    """Every forward output, empty: used by `kda_fwd` and by the custom op's fake (meta) implementation.
    q [B, T, H, K], v [B, T, H, V]; returns o [B, T, H, V] (v.dtype), ht [N, H, K, V] f32 and the saved dict."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    T_tot, io, f32 = B * T, v.dtype, torch.float32
    none = lambda: empty(q, 0, dtype=f32)  # a distinct tensor per unused slot (custom op outputs never alias)
    o = empty(q, B, T, H, V, dtype=io)
    ht = empty(q, n_seq, H, K, V, dtype=f32) if final else none()
    saved = {
        "w": empty(q, H, T_tot, K, dtype=io),
        "qg": empty(q, H, T_tot, K, dtype=io),
        "kg": empty(q, H, T_tot, K, dtype=io),
        "aqk": empty(q, H, T_tot, 64, dtype=io),
        "tm": empty(q, H, T_tot, 64, dtype=io),  # also a scratch of the prep kernel when not saving
        "akk": empty(q, H, T_tot, 64, dtype=io) if save else none(),
        "glast": empty(q, n_chunks, H, K, dtype=f32),
        "rq": empty(q, T_tot, H, dtype=f32) if l2norm else none(),  # 1 / ||q||, also read back inside the prep
        "rk": empty(q, T_tot, H, dtype=f32) if l2norm else none(),
        "h": empty(q, n_chunks, H, K, V, dtype=io) if save else none(),
        "vnew": empty(q, H, T_tot, V, dtype=io) if save else none(),
        "u": empty(q, H, T_tot, V, dtype=io),
    }
    return o, ht, saved


def kda_fwd(q, k, v, g, beta, a_log, dt_bias, h0, cu_seqlens, *, scale, lower_bound, gate, l2norm, final, save):
    """Both forward stages. q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] (made contiguous); h0
        [N, H, K, V] float32 or None; cu_seqlens [N + 1] or None; a_log [H], dt_bias [H, K] with `gate`.

        Returns o [B, T, H, V] (v.dtype), the final state [N, H, K, V] float32 (empty unless `final`) and the dict
        of tensors the backward needs (allocated empty unless `save`; "u" is a forward-only scratch, and
    without `save` so are "tm", "rq" and "rk").
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    T_tot = B * T
    layout = ChunkLayout(B, T, q.device, cu_seqlens)
    o, ht, saved = allocate_fwd(q, v, layout.n_seq, layout.n_chunks, final=final, save=save, l2norm=l2norm)
    q, k, v, g = (x.reshape(T_tot, H, x.shape[-1]).contiguous() for x in (q, k, v, g))
    beta = beta.reshape(T_tot, H).contiguous()
    prec, emu, a32 = dot_setup(v.dtype)
    io = TL_DTYPES[v.dtype]
    none = empty(q, 0, dtype=torch.float32)
    if not gate:
        a_log, dt_bias = none, none
    prep_fwd(q, k, v, g, beta, a_log, dt_bias, saved, layout, scale=scale, lower_bound=lower_bound, gate=gate,
             l2norm=l2norm, save=save, dtypes=(io, tl.float32 if a32 else io, prec, emu))  # fmt: skip

    cu, chunk_seq, chunk_tok, chunk_off, Tn, NT = layout.args()
    width = tuning_width(layout.n_seq * H)
    split = split_output(layout.n_seq * H)
    hbuf, vnew = saved["h"], saved["vnew"]
    if split and not save:  # the output pass needs S per chunk and D: scratch here, kept for the backward otherwise
        hbuf, vnew = empty(q, layout.n_chunks, H, K, V, dtype=v.dtype), empty(q, H, T_tot, V, dtype=v.dtype)
    BK = max(16, triton.next_power_of_2(K))
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), layout.n_seq, H)
    _state_fwd_kernel[grid](
        saved["w"], saved["u"], saved["qg"], saved["kg"], saved["aqk"], saved["glast"],
        none if h0 is None else h0, o, ht, hbuf, vnew,
        cu, chunk_off, Tn, NT, T_tot, width,
        H=H, K=K, V=V, BK=BK, VARLEN=layout.varlen, HAS_H0=h0 is not None,
        STORE_HT=final, SAVE=save or split, OUT=not split, IO=io, PREC=prec, EMU=emu,
    )  # fmt: skip
    if split:
        grid = lambda meta: (layout.n_chunks, H, triton.cdiv(V, meta["BV"]))
        _output_kernel[grid](
            saved["qg"], saved["aqk"], hbuf, vnew, o, cu, chunk_seq, chunk_tok, Tn, NT, T_tot,
            H=H, K=K, V=V, BK=BK, VARLEN=layout.varlen, IO=io, PREC=prec, EMU=emu,
        )  # fmt: skip
    del saved["u"]
    return o, ht, saved
