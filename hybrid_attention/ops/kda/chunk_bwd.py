"""KDA chunk backward driver: allocates the gradients, picks the grids and launches stages 0-4 in order (regate, reverse
state walk, score gradients, dq/dk/dg, l2norm); docs/kernels.md, "Stages", lists what each reads and writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.chunk_fwd import TL_DTYPES, gated_tile_width
from hybrid_attention.ops.kda.kernels.dqkg import _dqkg_kernel
from hybrid_attention.ops.kda.kernels.l2norm_bwd import _l2norm_bwd_kernel
from hybrid_attention.ops.kda.kernels.regate import _regate_kernel
from hybrid_attention.ops.kda.kernels.score_grad import _score_grad_kernel
from hybrid_attention.ops.kda.kernels.state_bwd import _state_bwd_kernel
from hybrid_attention.ops.kda.triton_utils import ChunkLayout, dot_setup, empty, narrow_span, tuning_width

# K tile of the dq/dk/dg kernel (a power of two, 16 to 256): 32 spills no registers, but 64 halves the number of
# latency-bound programs and wins (docs/kernels.md); the l2norm backward runs inside it for K <= DQKG_BK.
DQKG_BK = 64


def reduction_tile(V: int) -> int:
    """The V tile of the kernels that sum over V (score gradients, dq/dk/dg): a function of V alone."""
    return min(64, max(16, triton.next_power_of_2(V)))


def regate(q, k, g, beta, a_log, dt_bias, saved, layout, *, scale, lower_bound, gate, l2norm, io, dtypes):
    """Stage 0: W, qg, kg [H, T_total, K] in the io dtype (v's), as the forward's prep kernel computed them. q, k, g
    [T_total, H, K], beta [T_total, H] (contiguous), as the forward took them."""
    IO, _, PREC, EMU = dtypes
    T_tot, H, K = q.shape
    w, qg, kg = (empty(q, H, T_tot, K, dtype=io) for _ in range(3))
    cu, chunk_seq, chunk_tok, _, T, NT = layout.args()
    # Eight warps: the [64, 128] float32 tiles of W, qg and kg spill registers on four.
    _regate_kernel[(layout.n_chunks, H)](
        q,
        k,
        g,
        beta,
        a_log,
        dt_bias,
        saved["tm"],
        saved["rq"],
        saved["rk"],
        saved["fbad"],
        w,
        qg,
        kg,
        cu,
        chunk_seq,
        chunk_tok,
        scale,
        lower_bound,
        T,
        NT,
        T_tot,
        H=H,
        K=K,
        BKW=gated_tile_width(K),
        VARLEN=layout.varlen,
        GATE=gate,
        NARROW=narrow_span(gate, lower_bound),
        L2NORM=l2norm,
        IO=IO,
        PREC=PREC,
        EMU=EMU,
        num_warps=8,
    )
    return w, qg, kg


def state_bwd(saved, gated, do, dht, h0_needed, layout, *, K, V, dtypes):
    """Stage 1, with `gated` = (W, qg, kg) from stage 0.

    Returns (dh0 [N, H, K, V] f32 or empty, dS1 per chunk [chunks, H, K, V], dD [H, T_total, V])."""
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
        gated[1],
        gated[2],
        gated[0],
        saved["aqk"],
        saved["glast"],
        do,
        dht if dht is not None else none,
        dh0,
        dhbuf,
        dvnew,
        cu,
        chunk_off,
        T,
        NT,
        T_tot,
        tuning_width(N * H),
        H=H,
        K=K,
        V=V,
        BK=max(16, triton.next_power_of_2(K)),
        VARLEN=layout.varlen,
        HAS_DHT=dht is not None,
        HAS_H0=h0_needed,
        IO=IO,
        PREC=PREC,
        EMU=EMU,
    )
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
        do,
        saved["vnew"],
        dvnew,
        v,
        beta,
        saved["tm"],
        saved["akk"],
        dv,
        dbeta_v,
        daq,
        dak,
        cu,
        chunk_seq,
        chunk_tok,
        scale,
        T,
        NT,
        T_tot,
        H=H,
        V=V,
        BV=reduction_tile(V),
        VARLEN=layout.varlen,
        IO=IO,
        PREC=PREC,
        EMU=EMU,
    )
    return dv, daq, dak


def _l2norm_bwd(x, rstd, dy):
    """x [..., K] (input dtype), rstd [...] f32, dy [..., K] f32 -> dx [..., K] in x.dtype."""
    K = x.shape[-1]
    n_rows = x.numel() // K
    dx = empty(x, *x.shape)
    BK = max(16, triton.next_power_of_2(K))
    BR = max(1, 4096 // BK)
    _l2norm_bwd_kernel[(triton.cdiv(n_rows, BR),)](x, rstd, dy, dx, n_rows, K=K, BR=BR, BK=BK, num_warps=4)
    return dx


def kda_bwd(
    do, dht, q, k, v, g, beta, a_log, dt_bias, h0_needed, cu_seqlens, saved, *, scale, lower_bound, gate, l2norm
):
    """All three backward stages. do [B, T, H, V], dht [N, H, K, V] f32 or None; inputs as `kda_fwd`.

    Returns dq, dk, dv, dg (dz with the gate), dbeta in the dtypes of their inputs, dh0 [N, H, K, V] f32
    (empty unless h0_needed), and dA_log [H], d dt_bias [H, K] float32 (empty without the gate).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    T_tot = B * T
    io = v.dtype
    q, k, v, g = (x.reshape(T_tot, H, x.shape[-1]).contiguous() for x in (q, k, v, g))
    beta = beta.reshape(T_tot, H).contiguous()
    do = do.reshape(T_tot, H, V).to(io).contiguous()
    dht = None if dht is None else dht.float().contiguous()
    layout = ChunkLayout(B, T, q.device, cu_seqlens)
    prec, emu, a32 = dot_setup(io)
    dtypes = (TL_DTYPES[io], tl.float32 if a32 else TL_DTYPES[io], prec, emu)
    none = empty(q, 0, dtype=torch.float32)
    gated = regate(
        q,
        k,
        g,
        beta,
        a_log if gate else none,
        dt_bias if gate else none,
        saved,
        layout,
        scale=scale,
        lower_bound=lower_bound,
        gate=gate,
        l2norm=l2norm,
        io=io,
        dtypes=dtypes,
    )
    dh0, dhbuf, dvnew = state_bwd(saved, gated, do, dht, h0_needed, layout, K=K, V=V, dtypes=dtypes)
    del gated  # only the state walk reads them

    BK = min(DQKG_BK, max(16, triton.next_power_of_2(K)))
    NK = triton.cdiv(K, BK)
    f32 = torch.float32
    dbeta = empty(q, NK + 1, T_tot, H, dtype=f32)
    dv, daq, dak = score_grad(saved, do, dvnew, v, beta, dbeta[0], layout, scale=scale, dtypes=dtypes)

    fuse_l2 = l2norm and NK == 1  # one K tile holds the whole row: the l2norm backward runs in the same kernel
    dq = empty(q, T_tot, H, K, dtype=f32 if (l2norm and not fuse_l2) else q.dtype)
    dk = empty(k, T_tot, H, K, dtype=f32 if (l2norm and not fuse_l2) else k.dtype)
    dg = empty(g, *g.shape)
    parts = (lambda: torch.zeros(layout.n_chunks, H, K, device=q.device, dtype=f32)) if gate else (lambda: none)
    dalog, dbias = parts(), parts()
    cu, chunk_seq, chunk_tok, _, Tn, NT = layout.args()
    _dqkg_kernel[(layout.n_chunks * NK, H)](
        q,
        k,
        g,
        beta,
        a_log if gate else none,
        dt_bias if gate else none,
        saved["rq"] if l2norm else none,
        saved["rk"] if l2norm else none,
        do,
        saved["vnew"],
        dvnew,
        saved["h"],
        dhbuf,
        saved["tm"],
        daq,
        dak,
        dq,
        dk,
        dg,
        dbeta,
        dalog,
        dbias,
        cu,
        chunk_seq,
        chunk_tok,
        scale,
        lower_bound,
        Tn,
        NT,
        T_tot,
        H=H,
        K=K,
        V=V,
        BK=BK,
        NK=NK,
        BV=reduction_tile(V),
        VARLEN=layout.varlen,
        GATE=gate,
        NARROW=narrow_span(gate, lower_bound),
        L2NORM=l2norm,
        FUSE_L2=fuse_l2,
        IO=dtypes[0],
        ADT=dtypes[1],
        PREC=prec,
        EMU=emu,
    )
    if l2norm and not fuse_l2:
        dq = _l2norm_bwd(q, saved["rq"], dq)
        dk = _l2norm_bwd(k, saved["rk"], dk)
    shape = lambda x: x.view(B, T, H, x.shape[-1])
    dbeta = dbeta.sum(0).view(B, T, H).to(beta.dtype)
    da_log = dalog.sum((0, 2)) if gate else none
    ddt = dbias.sum(0) if gate else none
    return shape(dq), shape(dk), shape(dv), shape(dg), dbeta, dh0, da_log, ddt
