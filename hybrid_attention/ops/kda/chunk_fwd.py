"""KDA chunk forward driver: allocates the outputs, picks the grids and launches the stages in order (prep, state walk
and, when `split_output` says so, the output pass); docs/kernels.md, "Stages", lists what each reads and writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.kernels.output import _output_kernel
from hybrid_attention.ops.kda.kernels.prep import _prep_kernel, _prep_redo_kernel
from hybrid_attention.ops.kda.kernels.state_fwd import _state_fwd_kernel
from hybrid_attention.ops.kda.triton_utils import ChunkLayout, dot_setup, empty, narrow_span, tuning_width


def split_output(pairs: int) -> bool:
    """Whether the forward computes O in the separate output pass: for at most 32 (sequence, head) pairs, where the
    walk is long and its programs few; with more pairs the walk's programs already fill the GPU."""
    return tuning_width(pairs) <= 32


def gated_tile_width(K: int) -> int:
    """The K tile of W, qg, kg (kernels/regate.py): whole [64, 128] tiles, fewer and larger dots."""
    return min(128, max(16, triton.next_power_of_2(K)))


# What `allocate_fwd` allocates for the forward alone: the rest is kept for the backward.
SCRATCH = ("u", "w", "qg", "kg")

# Flags each program of the checked-path launch reads at once: few programs when none is set.
REDO_FLAGS = 256

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
        "aqk": empty(q, H, T_tot, 64, dtype=io),
        "tm": empty(q, H, T_tot, 64, dtype=io),  # also a scratch of the prep kernel when not saving
        "akk": empty(q, H, T_tot, 64, dtype=io) if save else none(),
        "glast": empty(q, n_chunks, H, K, dtype=f32),
        "rq": empty(q, T_tot, H, dtype=f32) if l2norm else none(),  # 1 / ||q||, also read back inside the prep
        "rk": empty(q, T_tot, H, dtype=f32) if l2norm else none(),
        "h": empty(q, n_chunks, H, K, V, dtype=io) if save else none(),
        "vnew": empty(q, H, T_tot, V, dtype=io) if save else none(),
        "fbad": empty(q, n_chunks, H, dtype=torch.int32) if save else none(),  # the first bad row per chunk
        # Forward scratch (SCRATCH): the backward computes W, qg, kg again (kernels/regate.py).
        "u": empty(q, H, T_tot, V, dtype=io),
        "w": empty(q, H, T_tot, K, dtype=io),
        "qg": empty(q, H, T_tot, K, dtype=io),
        "kg": empty(q, H, T_tot, K, dtype=io),
    }
    return o, ht, saved


def prep_fwd(
    q,
    k,
    v,
    g,
    beta,
    a_log,
    dt_bias,
    out,
    layout,
    *,
    scale,
    lower_bound,
    gate,
    l2norm,
    save,
    dtypes,
    checked_everywhere=False,
):
    """Launch the prep kernels: the plain path for every chunk, then the checked path for the chunks it flags (every
    chunk with `checked_everywhere`, which tests use to compare the two paths). q, k, g [T_total, H, K];
    v [T_total, H, V]; beta [T_total, H] (contiguous). `out` holds the preallocated outputs w, u, qg, kg, aqk, tm,
    glast, rq, rk, akk, fbad (see allocate_fwd); `dtypes` = (IO, ADT, PREC, EMU)."""
    T_tot, H, K = q.shape
    V = v.shape[-1]
    IO, ADT, PREC, EMU = dtypes
    BKA = min(32, max(16, triton.next_power_of_2(K)))
    BKW = gated_tile_width(K)
    BV = min(128, max(16, triton.next_power_of_2(V)))
    cu, chunk_seq, chunk_tok, _, T, NT = layout.args()
    outputs = [out[name] for name in ("w", "u", "qg", "kg", "aqk", "tm", "glast", "rq", "rk", "akk", "fbad")]
    lscr = empty(q, layout.n_chunks, H, 64, 64, dtype=torch.float32)  # L, for the inverse (kernels/prep.py)
    redo = empty(q, layout.n_chunks, H, dtype=torch.int8)
    meta = dict(
        H=H,
        K=K,
        V=V,
        BKA=BKA,
        BKW=BKW,
        BV=BV,
        VARLEN=layout.varlen,
        GATE=gate,
        NARROW=narrow_span(gate, lower_bound),
        L2NORM=l2norm,
        SAVE=save,
        IO=IO,
        ADT=ADT,
        PREC=PREC,
        EMU=EMU,
    )
    _prep_kernel[(layout.n_chunks, H)](
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        *outputs,
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
        **meta,
    )
    if checked_everywhere:
        redo.fill_(1)
    # The checked path, only for the chunks whose inputs the plain one cannot take (docs/kernels.md, "Non-finite
    # inputs"); without a host sync the launch always happens, and costs one flag load per program when none is set.
    n_flags = layout.n_chunks * H
    _prep_redo_kernel[(triton.cdiv(n_flags, REDO_FLAGS),)](
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        *outputs,
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
        **meta,
        FLAGS=REDO_FLAGS,
        num_warps=4,
        num_stages=1,
    )


def kda_fwd(q, k, v, g, beta, a_log, dt_bias, h0, cu_seqlens, *, scale, lower_bound, gate, l2norm, final, save):
    """Every forward stage. q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] (made contiguous); h0
    [N, H, K, V] float32 or None; cu_seqlens [N + 1] or None; a_log [H], dt_bias [H, K] with `gate`.

    Returns o [B, T, H, V] (v.dtype), the final state [N, H, K, V] float32 (empty unless `final`) and the dict
    of tensors the backward needs (allocated empty unless `save`; the SCRATCH tensors are the forward's alone and
    dropped here, and without `save` so are "tm", "rq" and "rk").
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
    prep_fwd(
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        saved,
        layout,
        scale=scale,
        lower_bound=lower_bound,
        gate=gate,
        l2norm=l2norm,
        save=save,
        dtypes=(io, tl.float32 if a32 else io, prec, emu),
    )

    cu, chunk_seq, chunk_tok, chunk_off, Tn, NT = layout.args()
    width = tuning_width(layout.n_seq * H)
    split = split_output(layout.n_seq * H)
    hbuf, vnew = saved["h"], saved["vnew"]
    if split and not save:  # the output pass needs S per chunk and D: scratch here, kept for the backward otherwise
        hbuf, vnew = empty(q, layout.n_chunks, H, K, V, dtype=v.dtype), empty(q, H, T_tot, V, dtype=v.dtype)
    BK = max(16, triton.next_power_of_2(K))
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), layout.n_seq, H)
    _state_fwd_kernel[grid](
        saved["w"],
        saved["u"],
        saved["qg"],
        saved["kg"],
        saved["aqk"],
        saved["glast"],
        none if h0 is None else h0,
        o,
        ht,
        hbuf,
        vnew,
        cu,
        chunk_off,
        Tn,
        NT,
        T_tot,
        width,
        H=H,
        K=K,
        V=V,
        BK=BK,
        VARLEN=layout.varlen,
        HAS_H0=h0 is not None,
        STORE_HT=final,
        SAVE=save or split,
        OUT=not split,
        IO=io,
        PREC=prec,
        EMU=emu,
    )
    if split:
        grid = lambda meta: (layout.n_chunks, H, triton.cdiv(V, meta["BV"]))
        _output_kernel[grid](
            saved["qg"],
            saved["aqk"],
            hbuf,
            vnew,
            o,
            cu,
            chunk_seq,
            chunk_tok,
            Tn,
            NT,
            T_tot,
            H=H,
            K=K,
            V=V,
            BK=BK,
            VARLEN=layout.varlen,
            IO=io,
            PREC=prec,
            EMU=emu,
        )
    for name in SCRATCH:
        del saved[name]
    return o, ht, saved
