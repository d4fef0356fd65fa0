"""Flash attention forward that also writes each query row's log-sum-exp, one program per block of query rows of one
(batch, head): the chunked MLA prefill's `kernel="triton"` (docs/kernels.md, "MLA decode kernels").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_attention.ops.mla.kernels.split import _dot
from hybrid_attention.ops.triton_support import autotune

LN2 = tl.constexpr(0.6931471805599453)

# (BLOCK_M, BLOCK_N) with (num_warps, num_stages): large tiles keep the tensor cores fed at head dim 128; BLOCK_N
# divides BLOCK_M, which the causal split needs.
CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64},
    {"BLOCK_M": 128, "BLOCK_N": 128},
    {"BLOCK_M": 128, "BLOCK_N": 64},
    {"BLOCK_M": 64, "BLOCK_N": 64},
]
WARPS_STAGES = [(4, 3), (8, 3), (8, 4), (4, 4)]


@triton.jit
def _attend(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    start,
    stop,
    rows,
    Tk,
    qk_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + offs_n
        k_ptrs = k_base + cols[None, :].to(tl.int64) * stride_kt + offs_d[:, None]  # (BLOCK_D, BLOCK_N): K^T
        v_ptrs = v_base + cols[:, None].to(tl.int64) * stride_vt + offs_dv[None, :]
        if MASKED or BLOCK_D != D:
            k = tl.load(k_ptrs, mask=(cols[None, :] < Tk) & (offs_d[:, None] < D), other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = _dot(q, k, IEEE) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        if MASKED:
            visible = cols[None, :] < Tk
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED or BLOCK_DV != DV:
            v = tl.load(v_ptrs, mask=(cols[:, None] < Tk) & (offs_dv[None, :] < DV), other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@autotune(CONFIGS, WARPS_STAGES, ["D", "DV", "CAUSAL"])
@triton.jit
def _attention_lse_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_ot,
    H,
    Tq,
    Tk,
    qk_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(rows[:, None] < Tq) & (offs_d[None, :] < D), other=0.0)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if CAUSAL:
        unmasked = pid_m * BLOCK_M  # keys every row of the block sees
        stop = tl.minimum((pid_m + 1) * BLOCK_M, Tk)
    else:
        unmasked = Tk - Tk % BLOCK_N
        stop = Tk
    acc, l_i, m_i = _attend(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        0,
        unmasked,
        rows,
        Tk,
        qk_scale,
        D,
        DV,
        BLOCK_D,
        BLOCK_DV,
        BLOCK_N,
        False,
        CAUSAL,
        IEEE,
    )
    acc, l_i, m_i = _attend(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        unmasked,
        stop,
        rows,
        Tk,
        qk_scale,
        D,
        DV,
        BLOCK_D,
        BLOCK_DV,
        BLOCK_N,
        True,
        CAUSAL,
        IEEE,
    )

    o = acc / l_i[:, None]
    o_ptrs = o_ptr + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_ot + offs_dv[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(rows[:, None] < Tq) & (offs_dv[None, :] < DV))
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(lse_ptr + (b * H + h) * Tq + rows, lse, mask=rows < Tq)
