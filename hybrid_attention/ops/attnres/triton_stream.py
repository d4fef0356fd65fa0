"""The backward of one step of a Full AttnRes residual stream: two Triton kernels that finish the gradients of the
sources the step is the first to read.

Step k (of K) reads the sources v_0 .. v_{n_k - 1}; its forward saved lse_k, rho_k, the rounded mixture h_k and the
logits z_k,i = r_i (u_k . v_i) of its sources. Backwards run from the last step down, so when step k's runs, the later
steps have left their share in the stream's tables: dh [K, M, D] (the sources' dtype), rows [K, 2 + S, M] (c, lse,
then the logits of the stream's S sources) and cols [2, K, D] (u, then the running dL/du), all in the compute dtype
but dh. Per row, with the notation of docs/math.md ("AttnRes backward"):

    local     (`_stream_local_kernel`) dh_k = RMSNorm backward at h_k (rounded to the sources' dtype, as the later
              reads see it), c_k = dh_k . h_k, the row's share of d norm_weight_k; dh_k, c_k, lse_k and u_k go into
              the tables (`stream_bwd_` copies the logits)
    assembly  (`_stream_bwd_kernel`) for each source v_i this step is the first reader of (its newest one; all of
              them for k = 0), with the table entries of k' = k .. K-1:
                  p = exp(z_k',i - lse_k'),  dz = p (dh_k' . v_i - c_k')
                  dv_i = sum_k' [p dh_k' + dz r_i u_k'] - (r_i^2 / D) (sum_k' dz z_k',i) v_i

so v_i is read once, and each (step, source) pair costs one read of a dh row instead of a read of the source, and
one dot product over D (the forward's logits spare the other). Two
kernels, not one: the assembly loop is bound by how many of its programs fit on an SM, and the local part's rows and
norm-weight sums would hold registers through it; splitting costs one more read of the dh_k rows.
The assembly kernel also writes dz r_i per (source, step, row); `stream_bwd_` then adds du_k' += sum_rows dz r_i v_i
for all k' >= k as one matrix product per source (cuBLAS, reading v_i once more). A step whose output has no
gradient stores dh_k = 0 and c_k = 0, which add exactly nothing. The local kernel's programs loop over blocks of rows
and sum their share of d norm_weight in registers, one partial row per program, summed in a fixed order
(deterministic, no atomics).
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.rows import (
    block_d,
    compute_tl_dtype,
    pointer_table,
    row_programs,
    source_bucket,
    split_scalar,
    table_alignment,
    tuned_over_row_blocks,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

# Programs per SM: each loops over blocks of rows; more than fit at once, so that a config with fewer registers per
# program keeps more in flight.
STREAM_BWD_PROGRAMS_PER_SM = 8
HALF = (torch.bfloat16, torch.float16)
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
    from hybrid_attention.ops.attnres.rows import rms_norm_bwd_rows, row_block
    from hybrid_attention.ops.attnres.triton_full import folded_query

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
        stats,  # [2, M] the step's lse, rho (compute dtype)
        queries,  # [K, D]
        key_ws,  # [K, D]
        norm_w,  # [D]
        dh_all,  # [K, M, D] the sources' dtype: row k written here
        rows,  # [K, R, M] compute dtype: c, lse (then logits)
        u_all,  # [K, D] compute dtype: u
        dnw_part,  # [programs, D] partial sums of d norm_weight (compute dtype)
        M,
        D,
        R,
        k,
        HAS_DX: tl.constexpr,
        CDT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        STAGES: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        src_ty = dh_all.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        k64 = tl.zeros([], tl.int64) + k  # int64 offsets (K M D can pass 2^31)
        if pid == 0:
            u = folded_query(queries + k64 * D, key_ws + k64 * D, offs_d, d_ok, CDT)
            tl.store(u_all + k64 * D + offs_d, u, mask=d_ok)
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
                c = tl.sum(dh * hr, axis=1)
            else:
                dh = tl.zeros([BLOCK_M, BLOCK_D], CDT)
                c = tl.zeros([BLOCK_M], CDT)
            tl.store(dh_all + k64 * M * D + at, dh.to(src_ty), mask=mask)
            tl.store(rows + k64 * R * M + rm, c, mask=m_ok)
            tl.store(rows + (k64 * R + 1) * M + rm, tl.load(stats + rm, mask=m_ok, other=0.0), mask=m_ok)
        tl.store(dnw_part + pid * D + offs_d, tl.sum(dnw_acc, axis=0), mask=d_ok)

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
        dh_all,  # [K, M, D] the sources' dtype: rows >= k read
        rows,  # [K, R, M] compute dtype: c, lse, the logits of the stream's sources
        u_all,  # [K, D] compute dtype: u
        dzr,  # [n, H, K - k, M] dz r per source, plane (hi, lo when SPLIT_DZR), step k.., row
        M,
        D,
        R,
        K,
        k,
        first_source,  # the stream's index of the first of the n sources (they are consecutive)
        n,
        eps,
        eps_lo,
        K_BUCKET,  # autotuning key only
        SPLIT_DZR: tl.constexpr,
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        STAGES: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        pid = tl.program_id(0)
        src_ty = dh_all.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        plane = (tl.zeros([], tl.int64) + K - k) * M  # int64 offsets (K M D can pass 2^31)
        for m0 in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rm, m_ok, at, mask = row_block(m0, offs_m, offs_d, d_ok, M, D)
            for j in range(0, n):
                j64 = tl.zeros([], tl.int64) + j
                ptr = tl.multiple_of(tl.load(table + j).to(tl.pointer_type(src_ty)), ALIGN)
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
                    dh_l = tl.load(dh_all + kk64 * M * D + at, mask=mask, other=0.0).to(CDT)
                    c_l = tl.load(rows + kk64 * R * M + rm, mask=m_ok, other=0.0)
                    lse_l = tl.load(rows + (kk64 * R + 1) * M + rm, mask=m_ok, other=0.0)
                    z_l = tl.load(rows + (kk64 * R + 2 + first_source + j64) * M + rm, mask=m_ok, other=0.0)
                    u_l = tl.load(u_all + kk64 * D + offs_d, mask=d_ok, other=0.0)
                    acc, s, dzr_l = _step_terms(v, r, dh_l, c_l, lse_l, z_l, u_l, acc, s)
                    _store_dzr(dzr, slot + (kk64 - k) * M + rm, plane, m_ok, dzr_l, SPLIT_DZR)
                out = acc - (r * r / D * s)[:, None] * v
                tl.store(dv + j64 * M * D + at, out.to(src_ty), mask=mask)


def _dzr_times_rows(dzr, v):
    """dzr [N, M] (the compute dtype, or hi and lo parts in v's half dtype) @ v [M, D] -> [N, D] in the compute dtype,
    accumulated in it."""
    if v.dtype not in HALF:  # dzr in v's dtype, float32 or float64
        return dzr @ v
    if v.is_cuda:
        return torch.mm(dzr, v, out_dtype=torch.float32)
    return dzr.float() @ v.float()  # no mixed-precision product on the CPU (interpreter tests)


def stream_bwd_(dx, h, stats, logits, queries, key_weights, norm_weight, sources, dh, rows, cols, step, eps):
    """The backward of step `step` of a stream (see the module docstring).

    Args:
        dx: [..., D] the gradient of the step's output, or None (then dh_step = 0).
        h, stats, logits: the step's forward results: h [..., D] in the sources' dtype, stats [2, ...] (lse, rho),
            logits [S_step, ...] (z of each source the step read), both in the compute dtype.
        queries, key_weights: [K, D], every step's; norm_weight: [D], this step's.
        sources: n x [..., D], the sources whose gradients this step completes: the last n it read.
        dh, rows, cols: the stream's tables [K, ..., D], [K, 2 + S, ...] (S >= S_step), [2, K, D]; entries `step`
            are written, cols[1] (dL/du of every step) is added to.

    Returns:
        (the sources' gradients [n, ..., D] in their dtype, d norm_weight [D] in the compute dtype).
    """
    s0 = sources[0]
    n, D, K = len(sources), s0.shape[-1], queries.shape[0]
    M = s0.numel() // D if D else 0
    cdt = stats.dtype
    split = s0.dtype in HALF
    dzr = torch.empty(n, 2 if split else 1, K - step, M, device=s0.device, dtype=s0.dtype if split else cdt)
    local_programs = row_programs(M, s0.device)
    dnw_part = torch.empty(local_programs, D, device=s0.device, dtype=cdt)
    dv = torch.empty(n, *s0.shape, device=s0.device, dtype=s0.dtype)
    read, R = logits.shape[0], rows.shape[1]
    rows[step, 2 : 2 + read] = logits
    if M == 0:
        cols[0, step] = queries[step].to(cdt) * key_weights[step].to(cdt)
        return dv, dnw_part.new_zeros(D)
    tl_cdt, width = compute_tl_dtype(cdt), block_d(D)
    _stream_local_kernel[(local_programs,)](
        h if dx is None else dx, h, stats, queries, key_weights, norm_weight, dh, rows, cols, dnw_part, M, D, R,
        step, HAS_DX=dx is not None, CDT=tl_cdt, BLOCK_D=width,
    )  # fmt: skip
    _stream_bwd_kernel[(row_programs(M, s0.device, STREAM_BWD_PROGRAMS_PER_SM),)](
        pointer_table(sources), dv, dh, rows, cols, dzr, M, D, R, K, step, read - n, n, *split_scalar(eps),
        source_bucket(K - step), SPLIT_DZR=split, CDT=tl_cdt, ALIGN=table_alignment(sources), BLOCK_D=width,
    )  # fmt: skip
    du = cols[1, step:]
    for i, v in enumerate(sources):  # a fixed order: deterministic
        du += _dzr_times_rows(dzr[i].view(-1, M), v.view(M, D)).view(-1, K - step, D).sum(0)
    return dv, dnw_part.sum(0)
