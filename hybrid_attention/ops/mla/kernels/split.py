"""MLA flash decode, stage 1: attention of every query row of a sequence over one range of its latent cache, one program
per (sequence, split, row block); docs/kernels.md, "MLA decode kernels".
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs must not be rounded to tf32 (the fp32 path is checked to 1e-5); 16-bit inputs use tensor cores.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _split_kernel(
    q_ptr,  # [B, Tq, H, D]
    rows_ptr,  # [B, max_len, D]
    seq_lens_ptr,  # [B] int32
    table_ptr,  # [B, max_len // PAGE] int32 page table (read only when PAGE > 0)
    out_ptr,  # [B, Tq, H, DV] (written only when SINGLE)
    m_ptr,  # [B, Tq * H, num_splits] fp32, base-2 running max
    l_ptr,  # [B, Tq * H, num_splits] fp32
    acc_ptr,  # [B, Tq * H, num_splits, DV] fp32
    stride_qb,
    stride_qt,
    stride_qh,
    stride_rb,  # of a sequence's rows, or of a page when PAGE > 0
    stride_rn,
    stride_tb,
    stride_ob,
    stride_ot,
    stride_oh,
    max_len,
    num_splits,
    qk_scale,  # scale * log2(e)
    TQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    SINGLE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    PAGE: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    m_block = tl.program_id(2)

    # Query rows are (t, h) pairs flattened t-major; row t sits at position seq_len - TQ + t (bottom-right causal).
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < TQ * H
    t = offs_m // H
    h = offs_m % H
    # Clamped so a bad length can never read outside the cache; checked on the host when it costs no sync.
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), max_len)
    last_key = seq_len - TQ + t  # [BLOCK_M]

    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt + h * stride_qh
    q_v = tl.load(q_rows[:, None] + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
    if HAS_TAIL:
        offs_t = DV + tl.arange(0, BLOCK_DT)
        t_ok = offs_t < D
        q_t = tl.load(q_rows[:, None] + offs_t[None, :], mask=row_ok[:, None] & t_ok[None, :], other=0.0)

    # This split's key range: whole blocks, so every split but the last of a sequence is unmasked.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    rows_b = rows_ptr + b.to(tl.int64) * stride_rb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGE > 0:  # each row through its page: the table entry of its page, then its place in the page
            page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + offs_n // PAGE, mask=n_ok, other=0)
            r_ptrs = (
                rows_ptr + page.to(tl.int64)[:, None] * stride_rb + (offs_n % PAGE).to(tl.int64)[:, None] * stride_rn
            )
        else:
            r_ptrs = rows_b + offs_n.to(tl.int64)[:, None] * stride_rn  # [BLOCK_N, 1]
        # Rows at or past seq_len may hold garbage or NaN: they are never loaded (other=0), so 0 * NaN cannot occur.
        if BLOCK_DV == DV:
            k_v = tl.load(r_ptrs + offs_v[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_v = tl.load(r_ptrs + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :], other=0.0)
        s = _dot(q_v, tl.trans(k_v), IEEE)  # [BLOCK_M, BLOCK_N]
        if HAS_TAIL:
            k_t = tl.load(r_ptrs + offs_t[None, :], mask=n_ok[:, None] & t_ok[None, :], other=0.0)
            s += _dot(q_t, tl.trans(k_t), IEEE)
        visible = n_ok[None, :] & (offs_n[None, :] <= last_key[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids (-inf) - (-inf) = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(k_v.dtype), k_v, IEEE)
        m_i = m_new

    if SINGLE:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = out_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh
        tl.store(
            o_rows[:, None] + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & v_ok[None, :],
        )
    else:
        part = (b.to(tl.int64) * (TQ * H) + offs_m) * num_splits + split  # [BLOCK_M] index into [B, Tq*H, splits]
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        # Rows that saw no key in this split (l = 0) skip the write; the merge never reads them.
        tl.store(
            acc_ptr + part[:, None] * DV + offs_v[None, :],
            acc,
            mask=(row_ok & (l_i > 0))[:, None] & v_ok[None, :],
        )
