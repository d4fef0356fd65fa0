"""The backward of one step of a Full AttnRes residual stream: the local, assembly and product kernels that finish the
gradients of the sources the step is the first to read (docs/kernels.md, "One step's backward").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.rows import (
    block_d,
    residual_scale,
    source_bucket,
    source_table,
    table_alignment,
    tuned_over_row_blocks,
)
from hybrid_attention.ops.numerics import HALF_DTYPES
from hybrid_attention.ops.triton_support import compute_tl_dtype, interpreting, row_programs, split_scalar

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

# Programs per SM: each loops over blocks of rows; more than fit at once, so that a config with fewer registers per
# program keeps more in flight.
STREAM_BWD_PROGRAMS_PER_SM = 8
STREAM_BWD_CONFIGS = [  # (BLOCK_M, num_warps, STAGES)
    (2, 2, 3),
    (2, 1, 3),
    (2, 1, 4),
    (1, 1, 3),
    (1, 1, 4),
    (2, 2, 4),
    (2, 1, 1),
    (2, 2, 1),
]
# The dL/du product: row blocks of DU_ROWS, DU_COLUMNS-wide column tiles, DU_STEPS steps per program, its rows split
# DU_SPLITS ways (one partial sum each); and COPY_BLOCK logits per copy in the local kernel. Not tuned: the product
# adds into its partial sums, so a timing run would add twice.
DU_ROWS, DU_COLUMNS, DU_STEPS, DU_SPLITS, DU_WARPS, DU_STAGES = 32, 128, 32, 64, 4, 3
COPY_BLOCK = 1024
STREAM_LOCAL_CONFIGS = [  # (BLOCK_M, num_warps, STAGES)
    (2, 4, 3),
    (2, 2, 3),
    (1, 2, 3),
    (1, 4, 3),
    (2, 4, 2),
    (2, 4, 1),
    (4, 8, 1),
]


if triton is not None:
    from hybrid_attention.ops.attnres.rows import rms_norm_bwd_rows, row_block, source_pointer
    from hybrid_attention.ops.attnres.triton_mix_norm import folded_query

    @triton.jit
    def _step_terms(v, r, dh, c, lse, z, u, acc, s):
        """One step's terms of the gradients of a block of rows v [BLOCK_M, BLOCK_D] of a source (r [BLOCK_M] its
        reciprocal norms, z [BLOCK_M] the step's logits of it): adds p dh + dz r u to acc and dz z to s; returns
        (acc, s, dz r)."""
        p = tl.exp(z - lse)
        dz = p * (tl.sum(v * dh, axis=1) - c)
        dzr = dz * r
        acc += p[:, None] * dh + dzr[:, None] * u[None, :]
        return acc, s + dz * z, dzr

    @triton.jit
    def _store_dzr(dzr, at, plane, m_ok, val, SPLIT: tl.constexpr):
        """dz r at `at`; SPLIT: as hi + lo, two numbers of the table's (half) dtype, the second `plane` further, so
        that a half-precision matrix product with float32 accumulation sees about 16 bits of it."""
        if SPLIT:
            hi = val.to(dzr.dtype.element_ty)
            tl.store(dzr + at, hi, mask=m_ok)
            tl.store(dzr + plane + at, (val - hi.to(val.dtype)).to(dzr.dtype.element_ty), mask=m_ok)
        else:
            tl.store(dzr + at, val.to(dzr.dtype.element_ty), mask=m_ok)

    # STREAM_LOCAL_CONFIGS; the first is the one the interpreter runs. With STAGES > 1 the compiler loads the next
    # row blocks while this one computes: with one block in flight per program the loop waits on every load.
    @tuned_over_row_blocks(
        [{"BLOCK_M": m, "num_warps": w, "STAGES": st} for m, w, st in STREAM_LOCAL_CONFIGS], key=["D", "HAS_DX"]
    )
    @triton.jit
    def _stream_local_kernel(
        dx,  # [M, D] the gradient of the step's output (read when HAS_DX)
        h,  # [M, D] the step's rounded mixture
        h_res,  # [M, D] int8: its rounding residual (`rows.residual_scale`), read when RES_SCALE
        stats,  # [2, M] the step's lse, rho (compute dtype)
        queries,  # [K, D]
        key_ws,  # [K, D]
        norm_w,  # [D]
        logits,  # [n_logits] the step's logits of its sources (compute dtype), copied into rows[k, 2:]
        dh_step,  # [M, D] the sources' dtype: the step's entry of its dh table, written here
        rows,  # [K, R, M] compute dtype: c, lse, then the logits
        u_all,  # [K, D] compute dtype: u
        dnw_part,  # [programs, K, D] compute dtype: partial sums of d norm_weight, [pid, k] written here
        M,
        D,
        R,
        K,
        k,
        n_logits,
        HAS_DX: tl.constexpr,
        RES_SCALE: tl.constexpr,
        CDT: tl.constexpr,
        COPY_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        STAGES: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        src_ty = dh_step.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        k64 = tl.zeros([], tl.int64) + k  # int64 offsets (K M D can pass 2^31)
        if pid == 0:
            u = folded_query(queries + k64 * D, key_ws + k64 * D, offs_d, d_ok, CDT)
            tl.store(u_all + k64 * D + offs_d, u, mask=d_ok)
        # The step's logits go to the table as one contiguous block (rows[k, 2 : 2 + S_k] is S_k rows of M).
        offs_c = tl.arange(0, COPY_BLOCK)
        z_rows = rows + (k64 * R + 2) * M
        for c0 in range(pid * COPY_BLOCK, n_logits, tl.num_programs(0) * COPY_BLOCK):
            c_ok = c0 + offs_c < n_logits
            tl.store(z_rows + c0 + offs_c, tl.load(logits + c0 + offs_c, mask=c_ok, other=0.0), mask=c_ok)
        nw = tl.load(norm_w + offs_d, mask=d_ok, other=0.0).to(CDT)
        # Per-row partial sums, added over the rows once at the end (no reduction per block of rows).
        dnw_acc = tl.zeros([BLOCK_M, BLOCK_D], CDT)
        for m0 in tl.range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M, num_stages=STAGES):
            rm, m_ok, at, mask = row_block(m0, offs_m, offs_d, d_ok, M, D)
            if HAS_DX:
                g = tl.load(dx + at, mask=mask, other=0.0).to(CDT)
                hr = tl.load(h + at, mask=mask, other=0.0).to(CDT)
                rho = tl.load(stats + M + rm, mask=m_ok, other=0.0).to(CDT)
                dh, dnw_rows = rms_norm_bwd_rows(g, hr, rho, nw, D)
                dnw_acc += dnw_rows
                dh = dh.to(src_ty).to(CDT)
                if RES_SCALE > 0:
                    # c = dh . h of the unrounded mixture: it cancels against the assembly's dh . v_i, and the rounded
                    # h would leave sum_i dz_i = dh . (h - h_r), amplified by that cancellation.
                    frac = tl.load(h_res + at, mask=mask, other=0).to(CDT)
                    c = tl.sum(dh * (hr + hr * frac * (1.0 / RES_SCALE)), axis=1)
                else:
                    c = tl.sum(dh * hr, axis=1)
            else:
                dh = tl.zeros([BLOCK_M, BLOCK_D], CDT)
                c = tl.zeros([BLOCK_M], CDT)
            tl.store(dh_step + at, dh.to(src_ty), mask=mask)
            tl.store(rows + k64 * R * M + rm, c, mask=m_ok)
            tl.store(rows + (k64 * R + 1) * M + rm, tl.load(stats + rm, mask=m_ok, other=0.0), mask=m_ok)
        tl.store(dnw_part + (pid * K + k64) * D + offs_d, tl.sum(dnw_acc, axis=0), mask=d_ok)

    # STREAM_BWD_CONFIGS; the first is the one the interpreter runs. STAGES > 1 has the compiler copy the later
    # steps' rows into shared memory that many steps ahead, so loads are in flight without holding registers: the
    # fastest for long loops; plain loops win for the last few steps (benchmarks/bench_attnres_configs.py).
    @tuned_over_row_blocks(
        [{"BLOCK_M": m, "num_warps": w, "STAGES": st} for m, w, st in STREAM_BWD_CONFIGS],
        key=["D", "K_BUCKET"],
    )
    @triton.jit
    def _stream_bwd_kernel(
        table,  # int64 [n]: data pointers of the n sources to assemble, each [M, D] contiguous
        dv,  # [n, M, D] their gradients (the sources' dtype)
        dh_early,  # [k_split, M, D] the sources' dtype: the dh table of steps < k_split (entries >= k read)
        dh_late,  # [K - k_split, M, D]: the dh table of the later steps
        rows,  # [K, R, M] compute dtype: c, lse, the logits of the stream's sources
        u_all,  # [K, D] compute dtype: u
        dzr,  # [n, H, K - k, M] dz r per source, plane (hi, lo when SPLIT_DZR), step k.., row
        M,
        D,
        R,
        K,
        k,
        k_split,
        first_source,  # the stream's index of the first of the n sources (they are consecutive)
        n,
        eps,
        eps_lo,
        K_BUCKET,  # autotuning key only
        DIRECT: tl.constexpr,  # n == 1 and `table` is that source itself (no table to build and copy)
        SPLIT_DZR: tl.constexpr,
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        STAGES: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        pid = tl.program_id(0)
        src_ty = dh_late.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        plane = (tl.zeros([], tl.int64) + K - k) * M  # int64 offsets (K M D can pass 2^31)
        for m0 in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rm, m_ok, at, mask = row_block(m0, offs_m, offs_d, d_ok, M, D)
            for j in range(0, n):
                j64 = tl.zeros([], tl.int64) + j
                ptr = source_pointer(table, j, src_ty, DIRECT, ALIGN)
                v = tl.load(ptr + at, mask=mask, other=0.0).to(CDT)
                r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
                acc = tl.zeros([BLOCK_M, BLOCK_D], CDT)
                s = tl.zeros([BLOCK_M], CDT)
                if SPLIT_DZR:
                    slot = j64 * 2 * plane
                else:
                    slot = j64 * plane
                for kk in tl.range(k, K, num_stages=STAGES):
                    kk64 = tl.zeros([], tl.int64) + kk
                    # One loop over both dh tables (one pipeline), the step's row picked from its table.
                    row_l = tl.where(kk < k_split, dh_early + kk64 * M * D, dh_late + (kk64 - k_split) * M * D)
                    dh_l = tl.load(row_l + at, mask=mask, other=0.0).to(CDT)
                    c_l = tl.load(rows + kk64 * R * M + rm, mask=m_ok, other=0.0)
                    lse_l = tl.load(rows + (kk64 * R + 1) * M + rm, mask=m_ok, other=0.0)
                    z_l = tl.load(rows + (kk64 * R + 2 + first_source + j64) * M + rm, mask=m_ok, other=0.0)
                    u_l = tl.load(u_all + kk64 * D + offs_d, mask=d_ok, other=0.0)
                    acc, s, dzr_l = _step_terms(v, r, dh_l, c_l, lse_l, z_l, u_l, acc, s)
                    _store_dzr(dzr, slot + (kk64 - k) * M + rm, plane, m_ok, dzr_l, SPLIT_DZR)
                out = acc - (r * r / D * s)[:, None] * v
                tl.store(dv + j64 * M * D + at, out.to(src_ty), mask=mask)

    @triton.jit
    def _du_kernel(
        table,  # int64 [n]: data pointers of the n sources, each [M, D] contiguous (the source itself when DIRECT)
        dzr,  # [n, H, K - k, M] dz r per source, plane, step k.., row: the sources' dtype when H = 2, else compute
        du_part,  # [splits, K, D] compute dtype: partial sums of dL/du, one per split of the rows; added to
        M,
        D,
        K,
        k,
        n,
        split_rows,  # rows per split, a multiple of BLOCK_M
        H: tl.constexpr,
        DIRECT: tl.constexpr,
        DOT: tl.constexpr,  # 1: tensor-core product (half), 2: full float32 product, 0: float64 by hand
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        STAGES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """du_part[split, k + s] += sum over the split's rows m and the n sources and H planes of dzr[j, h, s, m]
        v_j[m]: one program per (split, column tile, block of steps), its rows in a fixed order."""
        split = tl.program_id(0)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_s = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, BLOCK_M)
        src_ty = dzr.dtype.element_ty
        d_ok = offs_d < D
        s_ok = offs_s < K - k
        part_mask = s_ok[:, None] & d_ok[None, :]
        part = du_part + ((tl.zeros([], tl.int64) + split) * K + k + offs_s)[:, None] * D + offs_d[None, :]
        acc = tl.load(part, mask=part_mask, other=0.0)
        plane = (tl.zeros([], tl.int64) + K - k) * M
        start = split * split_rows
        end = tl.minimum(start + split_rows, M)
        for j in range(0, n):
            ptr = source_pointer(table, j, src_ty, DIRECT, ALIGN)
            for m0 in tl.range(start, end, BLOCK_M, num_stages=STAGES):
                rm = m0 + offs_m
                m_ok = rm < end
                v = tl.load(
                    ptr + rm.to(tl.int64)[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
                )
                for hh in tl.static_range(H):
                    at = (j * H + hh) * plane + offs_s.to(tl.int64)[:, None] * M + rm[None, :]
                    a = tl.load(dzr + at, mask=s_ok[:, None] & m_ok[None, :], other=0.0)
                    if DOT == 1:
                        acc = tl.dot(a, v, acc)
                    elif DOT == 2:
                        acc = tl.dot(a.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc += tl.sum(a.to(CDT)[:, :, None] * v.to(CDT)[None, :, :], axis=1)
        tl.store(part, acc, mask=part_mask)


def param_table_rows(M: int, device: torch.device) -> tuple[int, int]:
    """(splits of the dL/du product, programs of the local kernel) for a stream over M rows: the partial-sum rows of
    the stream's cols table [1 + splits + programs, K, D]."""
    splits = max(1, min(DU_SPLITS, -(-M // DU_ROWS)))
    return splits, row_programs(M, device)


def stream_param_grads(cols: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The complete dL/du and dL/d norm_weight [K, D] of every step, in a fixed order, from a stream's cols table
    (after its last backward) with `splits` partial sums of dL/du (`param_table_rows`)."""
    return cols[1 : 1 + splits].sum(0), cols[1 + splits :].sum(0)


def add_dzr_products_(sources, dzr, du_part, step, table=None):
    """du_part[split, step + s] += the split's share of sum_j sum_planes dzr[j, plane, s] @ v_j: the dL/du terms of
    the n sources for steps step .. K - 1.

    Args:
        sources: n x [..., D] contiguous, one dtype; `table`: their `source_table` (built here when None).
        dzr: [n, planes, K - step, M] (the assembly's dz r; two half planes for half sources).
        du_part: [splits, K, D] contiguous, the compute dtype, `param_table_rows(M)[0]` splits.
    """
    s0 = sources[0]
    n, D = len(sources), s0.shape[-1]
    M, K = dzr.shape[-1], du_part.shape[1]
    table = source_table(sources) if table is None else table
    cdt = du_part.dtype
    rows_per_split = -(-M // du_part.shape[0])
    split_rows = -(-rows_per_split // DU_ROWS) * DU_ROWS
    # Half sources under the interpreter take the float32 product (exact products, float32 sums, as on tensor
    # cores): its half-precision product is wrong.
    dot = 0 if cdt == torch.float64 else 1 if s0.dtype in HALF_DTYPES and not interpreting() else 2
    width = max(16, min(DU_COLUMNS, block_d(D)))
    _du_kernel[(du_part.shape[0], -(-D // width), -(-(K - step) // DU_STEPS))](
        table,
        dzr,
        du_part,
        M,
        D,
        K,
        step,
        n,
        split_rows,
        H=dzr.shape[1],
        DIRECT=n == 1,
        DOT=dot,
        CDT=compute_tl_dtype(cdt),
        ALIGN=table_alignment(sources),
        STAGES=DU_STAGES,
        BLOCK_M=DU_ROWS,
        BLOCK_D=width,
        BLOCK_K=DU_STEPS,
        num_warps=DU_WARPS,
    )


def stream_bwd_(
    dx, h, h_res, stats, logits, queries, key_weights, norm_weight, sources, dh_early, dh_late, rows, cols, step, eps
):
    """The backward of step `step` of a stream (docs/kernels.md, "One step's backward").

    Args:
        dx: [..., D] the gradient of the step's output, or None (then dh_step = 0).
        h, h_res, stats, logits: the step's forward results (`triton_mix_norm.full_fwd` with `save_h`, `save_logits`):
            h [..., D] in the sources' dtype, its int8 rounding residual (half sources; empty otherwise), stats
            [2, ...] (lse, rho), logits [S_step, ...] (z of each source the step read), both in the compute dtype.
        queries, key_weights: [K, D], every step's; norm_weight: [D], this step's.
        sources: n x [..., D], the sources whose gradients this step completes: the last n it read.
        dh_early, dh_late, rows, cols: the stream's tables: dh of the steps before k_split [k_split, ..., D] and from
            it on [K - k_split, ..., D] (dh_early may be any tensor while step >= k_split: it is not read),
            [K, 2 + S, ...] (S >= S_step) and [1 + splits + programs, K, D] (`param_table_rows`: u, then partial sums
            of dL/du and of dL/d norm_weight); entries `step` are written, the dL/du partial sums of every step added
            to.

    Returns:
        the sources' gradients [n, ..., D] in their dtype.
    """
    s0 = sources[0]
    n, D, K = len(sources), s0.shape[-1], queries.shape[0]
    M = s0.numel() // D if D else 0
    cdt = stats.dtype
    split_dzr = s0.dtype in HALF_DTYPES  # dz r as hi and lo parts in the sources' half dtype
    dv = torch.empty(n, *s0.shape, device=s0.device, dtype=s0.dtype)
    read, R = logits.shape[0], rows.shape[1]
    if M == 0:
        cols[0, step] = queries[step].to(cdt) * key_weights[step].to(cdt)
        return dv
    splits, local_programs = param_table_rows(M, s0.device)
    tl_cdt, width = compute_tl_dtype(cdt), block_d(D)
    k_split = K - dh_late.shape[0]
    dh_step = dh_late[step - k_split] if step >= k_split else dh_early[step]
    _stream_local_kernel[(local_programs,)](
        h if dx is None else dx,
        h,
        h_res,
        stats,
        queries,
        key_weights,
        norm_weight,
        logits,
        dh_step,
        rows,
        cols,
        cols[1 + splits :],
        M,
        D,
        R,
        K,
        step,
        read * M,
        HAS_DX=dx is not None,
        RES_SCALE=residual_scale(s0.dtype),
        CDT=tl_cdt,
        COPY_BLOCK=COPY_BLOCK,
        BLOCK_D=width,
    )
    table = source_table(sources)  # every step but the first has one source: no pointer table
    dzr = torch.empty(n, 2 if split_dzr else 1, K - step, M, device=s0.device, dtype=s0.dtype if split_dzr else cdt)
    _stream_bwd_kernel[(row_programs(M, s0.device, STREAM_BWD_PROGRAMS_PER_SM),)](
        table,
        dv,
        dh_early,
        dh_late,
        rows,
        cols,
        dzr,
        M,
        D,
        R,
        K,
        step,
        k_split,
        read - n,
        n,
        *split_scalar(eps),
        source_bucket(K - step),
        DIRECT=n == 1,
        SPLIT_DZR=split_dzr,
        CDT=tl_cdt,
        ALIGN=table_alignment(sources),
        BLOCK_D=width,
    )
    add_dzr_products_(sources, dzr, cols[1 : 1 + splits], step, table)
    return dv
