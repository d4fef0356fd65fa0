"""Triton flash-decoding kernels for absorbed MLA over the latent cache (MQA with one shared KV head).

Gated MLA with NoPE decodes as multi-query attention (docs/math.md, "Absorbed decode"): each cached token is
one row [c ; k_s] of D = d_c + d_s numbers, head h's absorbed query q'_h = [W_UK,h^T q_n,h ; q_s,h] has D entries,
the keys are the rows and the values are their first `value_dim` columns. Since every head reads the same KV head,
one program holds all Tq * H query rows of a sequence and scores them against each block of cache rows it loads:
a decode step reads the cache once for all heads.

Flash-decoding: the valid context of sequence b (its first seq_lens[b] rows) is cut into `num_splits` ranges of
whole key blocks, one program each (grid [B, num_splits, row blocks]). A program runs an online softmax (running
max m, sum l, unnormalised output acc, all fp32) over its range and writes (m, l, acc); `_merge_kernel` then
combines the splits exactly:

    o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,    M = max_s m_s.

With one split the first kernel normalises and writes the output itself. Scores live in base 2 (scale * log2(e) is
one multiplier) so both kernels use exp2. A query row that sees no key (only when seq_lens[b] < Tq) gets zeros.

D need not be a power of two (288 = 256 + 32): a row is read as a value part [:value_dim] and a tail
[value_dim:D], each padded to a power of two under a load mask, so nothing is padded when both are powers of two.

Static caches and CUDA graphs: the grid depends only on B, Tq, H and max_len (through num_splits); lengths are read
on the device, so a preallocated cache works and a captured graph stays valid while seq_lens changes.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

# Rows a split should stream at least, so that its start-up and (m, l, acc) write-back stay small next to its reads;
# small enough that batch-1 decoding at a few thousand tokens still spreads over dozens of SMs.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 512
RESIDENT_PER_SM = 2  # programs an SM holds at once with the default config (~85 KB shared memory each on sm_90)
MERGE_BLOCK_S = 32
MERGE_BLOCK_D = 64


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
    out_ptr,  # [B, Tq, H, DV] (written only when SINGLE)
    m_ptr,  # [B, Tq * H, num_splits] fp32, base-2 running max
    l_ptr,  # [B, Tq * H, num_splits] fp32
    acc_ptr,  # [B, Tq * H, num_splits, DV] fp32
    stride_qb,
    stride_qt,
    stride_qh,
    stride_rb,
    stride_rn,
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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(programs_per_split: int, max_len: int, num_sms: int) -> int:
    """Splits per sequence so that `programs_per_split * num_splits` fills one wave of resident programs.

    `programs_per_split` is B times the number of query-row blocks. One full wave (rounded down, never up: a second,
    nearly empty wave would cost a whole program's time) streams the cache with every SM busy. Each split keeps at
    least MIN_SPLIT_TOKENS rows of a full-length context. Depends only on shapes (never on seq_lens): graph safe.
    """
    want = (RESIDENT_PER_SM * num_sms) // programs_per_split
    useful = triton.cdiv(max_len, MIN_SPLIT_TOKENS)
    return max(1, min(want, useful, MAX_SPLITS))


def _config(block_dv: int, block_dt: int, has_tail: bool, elem_bytes: int, block_m: int):
    """(block_n, num_warps, num_stages): about 36 KB of cache rows per pipeline stage, at most ~110 KB in flight."""
    row_bytes = (block_dv + (block_dt if has_tail else 0)) * elem_bytes
    block_n = 64
    while block_n > 16 and block_n * row_bytes > 40 * 1024:
        block_n //= 2
    num_stages = 3 if 3 * block_n * row_bytes <= 110 * 1024 else 2
    num_warps = 4 if block_m <= 32 else 8
    return block_n, num_warps, num_stages


def launch_plan(
    q: torch.Tensor,
    rows: torch.Tensor,
    *,
    value_dim: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> dict:
    """Block sizes, split count and launch options for q [B, Tq, H, D] over rows [B, max_len, D].

    Depends on shapes, dtype and the device only (never on seq_lens values). None means the tuned default.
    """
    B, Tq, H, D = q.shape
    max_len = rows.shape[1]
    n_rows = Tq * H
    block_m = max(16, min(64, triton.next_power_of_2(n_rows)))
    m_blocks = triton.cdiv(n_rows, block_m)
    has_tail = D > value_dim
    block_dv = max(16, triton.next_power_of_2(value_dim))
    block_dt = max(16, triton.next_power_of_2(D - value_dim)) if has_tail else 16
    d_block_n, d_warps, d_stages = _config(block_dv, block_dt, has_tail, q.element_size(), block_m)
    block_n = block_n or d_block_n
    if num_splits is None:
        if q.device.type == "cuda":
            num_sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
        else:
            num_sms = 4  # the interpreter: a few splits, so CPU runs stay quick
        num_splits = default_num_splits(B * m_blocks, max_len, num_sms)
    return dict(
        n_rows=n_rows,
        block_m=block_m,
        m_blocks=m_blocks,
        has_tail=has_tail,
        block_dv=block_dv,
        block_dt=block_dt,
        block_n=block_n,
        num_warps=num_warps or d_warps,
        num_stages=num_stages or d_stages,
        # More splits than key blocks in the whole cache could only ever be empty.
        num_splits=max(1, min(num_splits, triton.cdiv(max_len, block_n))),
    )


def mla_decode_triton(
    q: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Launch the decode kernels. Inputs are assumed checked by `hybrid_attention.ops.mla.decode.mla_decode`.

    q [B, Tq, H, D], rows [B, max_len, D] (last-dim stride 1), seq_lens int32 [B] -> [B, Tq, H, value_dim] in
    q.dtype. `block_n`, `num_warps` and `num_stages` override the tuned defaults (for benchmarks).
    """
    B, Tq, H, _ = q.shape
    if rows.stride(-1) != 1:
        raise ValueError(f"mla_decode_triton: rows must have unit stride in its last dim, got {rows.stride()}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    plan = launch_plan(
        q, rows, value_dim=value_dim, num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages
    )
    n_rows, num_splits = plan["n_rows"], plan["num_splits"]
    out = torch.empty(B, Tq, H, value_dim, device=q.device, dtype=q.dtype)
    single = num_splits == 1
    if single:
        m_part = l_part = acc_part = out  # unused by the SINGLE kernel
    else:
        m_part = torch.empty(B, n_rows, num_splits, device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B, n_rows, num_splits, value_dim, device=q.device, dtype=torch.float32)

    # Triton launches on the current device: make it q's (a no-op in the usual single-GPU case).
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _launch(q, rows, seq_lens, out, m_part, l_part, acc_part, plan, value_dim, scale)
    return out


def _launch(q, rows, seq_lens, out, m_part, l_part, acc_part, plan, value_dim, scale):
    B, Tq, H, D = q.shape
    n_rows, num_splits = plan["n_rows"], plan["num_splits"]
    single = num_splits == 1
    _split_kernel[(B, num_splits, plan["m_blocks"])](
        q,
        rows,
        seq_lens,
        out,
        m_part,
        l_part,
        acc_part,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        rows.shape[1],
        num_splits,
        float(scale) * math.log2(math.e),
        TQ=Tq,
        H=H,
        D=D,
        DV=value_dim,
        HAS_TAIL=plan["has_tail"],
        SINGLE=single,
        IEEE=q.dtype == torch.float32,
        BLOCK_M=plan["block_m"],
        BLOCK_N=plan["block_n"],
        BLOCK_DV=plan["block_dv"],
        BLOCK_DT=plan["block_dt"],
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )
    if not single:
        block_d = min(MERGE_BLOCK_D, plan["block_dv"])
        _merge_kernel[(B, n_rows, triton.cdiv(value_dim, block_d))](
            m_part,
            l_part,
            acc_part,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            num_splits,
            TQ=Tq,
            H=H,
            DV=value_dim,
            BLOCK_S=MERGE_BLOCK_S,
            BLOCK_D=block_d,
            num_warps=4,
        )
