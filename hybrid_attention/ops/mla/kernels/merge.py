"""MLA flash decode, stage 2: the exact merge of the splits' partial softmaxes, one program per (sequence, query row, DV
block); docs/kernels.md, "MLA decode kernels".
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    m_ptr,  # [B, Tq * H, num_splits] fp32
    l_ptr,  # [B, Tq * H, num_splits] fp32
    acc_ptr,  # [B, Tq * H, num_splits, DV] fp32
    out_ptr,  # [B, Tq, H, DV]
    stride_ob,
    stride_ot,
    stride_oh,
    num_splits,
    TQ: tl.constexpr,
    H: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.program_id(1)
    d_block = tl.program_id(2)
    t = row // H
    h = row % H
    base = (b.to(tl.int64) * (TQ * H) + row) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < DV

    # Pass 1: the largest running max over all splits (empty splits hold -inf).
    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        m_vec = tl.maximum(m_vec, tl.load(m_ptr + base + s0 + offs_s, mask=s_ok, other=float("-inf")))
    m_all = tl.max(m_vec, axis=0)
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)

    # Pass 2: rescale every split to the common max and add up numerators and denominators.
    l_vec = tl.zeros([BLOCK_S], tl.float32)
    o = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        m_s = tl.load(m_ptr + base + s0 + offs_s, mask=s_ok, other=float("-inf"))
        l_s = tl.load(l_ptr + base + s0 + offs_s, mask=s_ok, other=0.0)
        w = tl.exp2(m_s - m_ref)  # 0 for empty splits
        l_vec += w * l_s
        a_ptrs = acc_ptr + (base + s0 + offs_s)[:, None] * DV + offs_d[None, :]
        a = tl.load(a_ptrs, mask=(s_ok & (l_s > 0))[:, None] & d_ok[None, :], other=0.0)
        o += tl.sum(w[:, None] * a, axis=0)
    l_all = tl.sum(l_vec, axis=0)
    o = o / tl.where(l_all > 0, l_all, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_ok)
