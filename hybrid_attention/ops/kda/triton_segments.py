"""KDA forward, the state walk in segments: parallel over the chunks of one long sequence, not only over sequences.

The walk (triton_fwd.py) is sequential over the chunks of each (sequence, head), so with few long sequences a few
programs walk a thousand chunks each. Each step is affine in the state (MATH.md, "Chunkwise form"):

    S' = Diag(2^Gam) S + kg^T (U - W S)  =  M S + C,    M = Diag(2^Gam) - kg^T W,    C = kg^T U

so a segment of L chunks maps its start state to its end state by S_end = A S_start + B, with A = M_L ... M_1
[K, K] and B the end state from a zero start [K, V]. Three passes instead of one walk:

    1. `_segment_transfer_kernel`, every segment in parallel: the walk applied to [I | 0] with U read as [0 | U]
       (K + V columns) gives [A | B] at the segment's end.
    2. `_segment_chain_kernel`, per (sequence, head): S_start of every segment by S <- A S + B, in float32 (the
       number of segments is small), and the final state.
    3. the ordinary walk (`_state_fwd_kernel` in triton_fwd.py) over every segment in parallel, each from its true
       start state, as if the segments were the sequences of a packed batch (same chunk indices): it stores S per
       chunk and D, and the output pass computes O from them.

Work: 2 + V / (K + V) walks' worth (three at K = V) instead of one, spread over segments x more programs. Rounding:
pass 1 rounds its [I | 0] walk to the io dtype as the walk rounds S (the dots' operands), so A and B carry the
rounding of a walk of L chunks. Used only with the split output pass and equal-length sequences (see
`segment_chunks`); off by default until it has been timed on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.triton_utils import (
    CHUNK,
    advance_state,
    autotune,
    empty,
    load_raw,
    load_state,
    mm,
    state_slice,
    store_state,
    tuning_width,
)


@autotune([{"BC": 32}, {"BC": 64}], [(4, 2), (4, 1)], ["K", "V", "WIDTH"])
@triton.jit(do_not_specialize=["T", "NT", "T_tot", "LSEG", "NSEG", "WIDTH"])
def _segment_transfer_kernel(
    w, u, kg, glast, xfer,  # prep outputs (w, kg [H, T_tot, K], u [H, T_tot, V], glast [chunks, H, K]); xfer out
    T, NT, T_tot, LSEG, NSEG, WIDTH,  # LSEG chunks per segment, NSEG segments per sequence; WIDTH: tuning key only
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    IO: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """[A | B] of one (segment, head) for columns ic * BC + [0, BC) of K + V: xfer [segments, H, K, K + V] f32."""
    ic = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    n = s // NSEG
    bos = n * T + (s % NSEG) * LSEG * 64
    eos = tl.minimum(bos + LSEG * 64, n * T + T)
    c0 = n * NT + (s % NSEG) * LSEG
    rk = tl.arange(0, BK)
    cols = ic * BC + tl.arange(0, BC)
    r = tl.arange(0, 64)
    identity = (rk[:, None] == cols[None, :]) & (cols < K)[None, :]
    X = tl.where(identity, 1.0, 0.0)  # [BK, BC] float32: the start [I | 0]
    u_cols = tl.maximum(cols - K, 0)
    u_ok = (cols >= K) & (cols < K + V)
    w_h = w + h.to(tl.int64) * T_tot * K
    kg_h = kg + h.to(tl.int64) * T_tot * K
    u_h = u + h.to(tl.int64) * T_tot * V
    for j in range(0, tl.cdiv(eos - bos, 64)):
        t0 = bos + j * 64
        nv = eos - t0
        Wt = load_raw(w_h, t0, nv, K, 0, K, 64, BK)
        u_offs = (t0 + r).to(tl.int64)[:, None] * V + u_cols[None, :]
        Ut = tl.load(u_h + u_offs, mask=(r < nv)[:, None] & u_ok[None, :], other=0.0).to(tl.float32)
        D = Ut - mm(Wt, X, IO, PREC, EMU)
        Kt = load_raw(kg_h, t0, nv, K, 0, K, 64, BK)
        X = advance_state(X, Kt, D, glast, c0 + j, h, H, K, BK, IO, PREC, EMU)
    offs = (s * H + h).to(tl.int64) * K * (K + V) + rk[:, None] * (K + V) + cols[None, :]
    tl.store(xfer + offs, X, mask=(rk < K)[:, None] & (cols < K + V)[None, :])


@triton.jit
def _segment_chain_kernel(
    xfer, h0, starts, ht, nxt,  # xfer [segments, H, K, K + V], starts [segments, H, K, V]; h0, ht, nxt [N, H, K, V]
    NSEG,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, RB: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):  # fmt: skip
    """The start state of every segment of sequence n, head h (V tile iv), and the sequence's final state.

    S <- A S + B in exact float32 dots, A read RB rows at a time in a loop that is not unrolled: the whole [K, K]
    A at once spilled 12.6 KB of stack per thread at K = 128, an unrolled loop 3.5 KB (sm_90 compiles,
    tools/kernel_stats.py); this way 105 registers, no stack. Each row block of the new S goes to `nxt`, which is
    read back whole for the next step."""
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    soffs, smask = state_slice(iv, K, V, BK, BV)
    S = load_state(h0, n * H + h, soffs, smask, HAS_H0, K, V, BK, BV)
    rk = tl.arange(0, BK)
    rb = tl.arange(0, RB)
    rv = iv * BV + tl.arange(0, BV)
    k_ok = rk < K
    v_ok = rv < V
    nxt_nh = nxt + (n * H + h).to(tl.int64) * K * V
    for j in range(0, NSEG):
        s = n * NSEG + j
        store_state(starts, s * H + h, S, soffs, smask, K, V)
        base = xfer + (s * H + h).to(tl.int64) * K * (K + V)
        for r0 in range(0, K, RB):
            rows = r0 + rb
            r_ok = rows < K
            A = tl.load(base + rows[:, None] * (K + V) + rk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            B = tl.load(base + rows[:, None] * (K + V) + K + rv[None, :], mask=r_ok[:, None] & v_ok[None, :], other=0.0)
            new = tl.dot(A, S, input_precision="ieee") + B
            tl.store(nxt_nh + rows[:, None] * V + rv[None, :], new, mask=r_ok[:, None] & v_ok[None, :])
        tl.debug_barrier()  # this program's row blocks are all stored before it reads them back
        S = tl.load(nxt_nh + soffs, mask=smask, other=0.0)
        tl.debug_barrier()  # and read before the next step overwrites them
    if STORE_HT:
        store_state(ht, n * H + h, S, soffs, smask, K, V)


def segment_chunks(n_chunks_per_seq: int, pairs: int, varlen: bool) -> int:
    """Chunks per segment for the segmented walk, or 0 for the plain walk. HA_KDA_SEGMENT_CHUNKS: "0" (the default,
    until timed on a GPU) or a number of chunks L >= 1; segments are used when a sequence has more than L chunks,
    the sequences are of equal length (not varlen) and the output pass is split (the caller's condition)."""
    mode = os.environ.get("HA_KDA_SEGMENT_CHUNKS", "0")
    if not mode.isdigit():
        raise ValueError(f"HA_KDA_SEGMENT_CHUNKS must be a number of chunks (0: off), got {mode!r}")
    L = int(mode)
    return L if L and not varlen and n_chunks_per_seq > L else 0


def segment_starts(saved, h0, ht, layout, *, seg_chunks, H, K, V, BK, final, dtypes):
    """Passes 1 and 2: the start state of every segment and (with `final`) the final states into ht.

    Returns (starts [segments, H, K, V] float32, cu [segments + 1] int32 token bounds, chunk_off [segments] int32
    first chunk of each segment): the packed layout under which pass 3 walks the segments as sequences."""
    io, prec, emu = dtypes
    q = saved["w"]
    n_seg = triton.cdiv(layout.nt, seg_chunks)
    total = layout.n_seq * n_seg
    T_tot = layout.n_seq * layout.T
    xfer = empty(q, total, H, K, K + V, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(K + V, meta["BC"]), total, H)
    _segment_transfer_kernel[grid](
        saved["w"], saved["u"], saved["kg"], saved["glast"], xfer,
        layout.T, layout.nt, T_tot, seg_chunks, n_seg, tuning_width(total * H),
        H=H, K=K, V=V, BK=BK, IO=io, PREC=prec, EMU=emu,
    )  # fmt: skip
    starts = empty(q, total, H, K, V, dtype=torch.float32)
    none = empty(q, 0, dtype=torch.float32)
    bv = min(32, max(16, triton.next_power_of_2(V)))
    nxt = empty(q, layout.n_seq, H, K, V, dtype=torch.float32)
    _segment_chain_kernel[(triton.cdiv(V, bv), layout.n_seq, H)](
        xfer, none if h0 is None else h0, starts, ht, nxt, n_seg,
        H=H, K=K, V=V, BK=BK, BV=bv, RB=min(BK, 32), HAS_H0=h0 is not None, STORE_HT=final, num_warps=4,
    )  # fmt: skip
    seg = torch.arange(total, device=q.device, dtype=torch.int32)
    seq, part = seg // n_seg, seg % n_seg
    chunk_off = seq * layout.nt + part * seg_chunks
    bos = seq * layout.T + part * seg_chunks * CHUNK
    cu = torch.cat([bos, bos.new_full((1,), T_tot)])  # built on the device: no host copy, CUDA-graph safe
    return starts, cu, chunk_off.to(torch.int32)
