"""Full AttnRes fused with the next sublayer's RMSNorm, for training: forward and backward Triton kernels over sources
read through a pointer table (docs/kernels.md, "Training, one Full AttnRes").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.rows import (
    block_d,
    pointer_table,
    residual_scale,
    source_bucket,
    table_alignment,
    tuned_over_sources,
)
from hybrid_attention.ops.numerics import compute_dtype
from hybrid_attention.ops.triton_support import compute_tl_dtype, row_programs, split_scalar

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

# The parameter-gradient sum: PARAM_BLOCK columns per program and PARAM_ROWS partial rows per load. Narrow columns
# give many programs: a few wide ones each walk all partial rows alone, one load after another.
PARAM_BLOCK = 32
PARAM_ROWS = 64
# Backward programs per SM: more than fit at once, so that a config with fewer registers per program keeps more in
# flight; the rest wait for a free slot (every program has the same number of rows).
FULL_BWD_PROGRAMS_PER_SM = 8


FULL_FWD_CONFIGS = [  # (BLOCK_S, num_warps, STAGES)
    (4, 2, 3),
    (2, 1, 3),
    (4, 1, 3),
    (1, 1, 3),
    (2, 2, 3),
    (4, 4, 3),
    (2, 1, 1),
    (4, 2, 1),
    (4, 4, 1),
    (2, 2, 1),
]


if triton is not None:

    @triton.jit
    def folded_query(query, key_w, offs_d, d_ok, CDT: tl.constexpr):
        """u = w * gamma in the compute dtype, zero past D: the key-norm weight folded into the pseudo-query."""
        w = tl.load(query + offs_d, mask=d_ok, other=0.0).to(CDT)
        return w * tl.load(key_w + offs_d, mask=d_ok, other=0.0).to(CDT)

    # (BLOCK_S, num_warps, STAGES); the first is the one the interpreter runs. With one warp per row the row sums
    # need no shared memory, and small programs keep more rows in flight per SM; STAGES > 1 has the compiler copy the
    # next source tiles into shared memory while this one computes, without holding them in registers.
    @tuned_over_sources([{"BLOCK_S": b, "num_warps": w, "STAGES": st} for b, w, st in FULL_FWD_CONFIGS])
    @triton.jit
    def _full_fwd_kernel(
        table,  # int64 [S]: data pointers of the S sources, each [M, D] contiguous
        first,  # source 0 (its element type is the sources')
        query,  # [D]
        key_w,  # [D]
        norm_w,  # [D]
        out,  # [M, D], the sources' dtype
        h_out,  # [M, D], the sources' dtype: the rounded mixture, written when SAVE_H
        h_res,  # [M, D] int8: its rounding residual, written when SAVE_H and RES_SCALE (`rows.residual_scale`)
        stats,  # [2, M] compute dtype: lse, then rho
        logits,  # [S, M] compute dtype: z, written when SAVE_Z
        M,
        S,
        D,
        eps,
        eps_lo,
        norm_eps,
        norm_eps_lo,
        S_BUCKET,  # autotuning key only
        SAVE_H: tl.constexpr,
        SAVE_Z: tl.constexpr,
        RES_SCALE: tl.constexpr,
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_S: tl.constexpr,
        STAGES: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Scalars come as fp32 (fp64 under inductor): one dtype for the loop-carried softmax state.
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        norm_eps = tl.cast(norm_eps, CDT) + tl.cast(norm_eps_lo, CDT)
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        u = folded_query(query, key_w, offs_d, d_ok, CDT)
        run_max = tl.full([], float("-inf"), CDT)
        run_sum = tl.zeros([], CDT)
        acc = tl.zeros([BLOCK_D], CDT)
        for s0 in tl.range(0, S, BLOCK_S, num_stages=STAGES):
            s_ok = s0 + offs_s < S
            ptr = tl.load(table + s0 + offs_s, mask=s_ok, other=0).to(tl.pointer_type(first.dtype.element_ty))
            ptr = tl.multiple_of(ptr, ALIGN)
            v = tl.load(ptr[:, None] + row * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            v = v.to(CDT)
            z = tl.sum(v * u[None, :], axis=1) * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
            if SAVE_Z:
                tl.store(logits + (s0 + offs_s).to(tl.int64) * M + row, z, mask=s_ok)
            z = tl.where(s_ok, z, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(z, axis=0))
            rescale = tl.exp(run_max - new_max)  # 0 on the first chunk
            p = tl.exp(z - new_max)
            run_sum = run_sum * rescale + tl.sum(p, axis=0)
            acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
            run_max = new_max
        # h is rounded to the output dtype before the norm, as the unfused composition does.
        mixture = acc / run_sum
        h = mixture.to(out.dtype.element_ty).to(CDT)
        rho = tl.rsqrt(tl.sum(h * h, axis=0) / D + norm_eps)
        nw = tl.load(norm_w + offs_d, mask=d_ok, other=0.0).to(CDT)
        tl.store(out + row * D + offs_d, (h * rho * nw).to(out.dtype.element_ty), mask=d_ok)
        if SAVE_H:
            tl.store(h_out + row * D + offs_d, h.to(out.dtype.element_ty), mask=d_ok)
            if RES_SCALE > 0:
                # (mixture - h) / h in [-127, 127] units (clamped: only subnormal h can leave them).
                frac = (mixture - h) / tl.where(h != 0, h, 1.0) * RES_SCALE  # h = 0 only where the mixture is
                frac = tl.minimum(tl.maximum(tl.floor(frac + 0.5), -127.0), 127.0)
                tl.store(h_res + row * D + offs_d, frac.to(tl.int8), mask=d_ok)
        tl.store(stats + row, run_max + tl.log(run_sum))
        tl.store(stats + M + row, rho)

    @tuned_over_sources([{"BLOCK_S": b, "num_warps": w} for b, w in [(4, 4), (2, 4), (2, 8), (4, 8), (8, 8)]])
    @triton.jit
    def _full_bwd_kernel(
        table,  # int64 [S] source pointers, as in the forward
        first,
        query,
        key_w,
        norm_w,
        dout,  # [M, D] gradient of the output (the sources' dtype)
        stats,  # [2, M]: lse, rho
        dsrc,  # [S, M, D] gradients of the sources (the sources' dtype)
        du_part,  # [programs, D] partial sums of dL/du
        dnw_part,  # [programs, D] partial sums of dL/d norm_weight
        M,
        S,
        D,
        eps,
        eps_lo,
        S_BUCKET,  # autotuning key only
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        pid = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        u = folded_query(query, key_w, offs_d, d_ok, CDT)
        nw = tl.load(norm_w + offs_d, mask=d_ok, other=0.0).to(CDT)
        du_acc = tl.zeros([BLOCK_D], CDT)
        dnw_acc = tl.zeros([BLOCK_D], CDT)
        for row in range(pid, M, tl.num_programs(0)):
            base = (tl.zeros([], tl.int64) + row) * D  # int64 offsets (the interpreter's row is an int)
            lse = tl.load(stats + row).to(CDT)
            rho = tl.load(stats + M + row).to(CDT)
            dx = tl.load(dout + base + offs_d, mask=d_ok, other=0.0).to(CDT)
            # Pass 1: h = sum_i p_i v_i from the saved lse.
            h = tl.zeros([BLOCK_D], CDT)
            for s0 in range(0, S, BLOCK_S):
                s_ok = s0 + offs_s < S
                ptr = tl.load(table + s0 + offs_s, mask=s_ok, other=0).to(tl.pointer_type(first.dtype.element_ty))
                ptr = tl.multiple_of(ptr, ALIGN)
                v = tl.load(ptr[:, None] + base + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
                v = v.to(CDT)
                z = tl.sum(v * u[None, :], axis=1) * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
                p = tl.where(s_ok, tl.exp(z - lse), 0.0)
                h += tl.sum(p[:, None] * v, axis=0)
            # RMSNorm backward at the rounded h the forward normalised.
            hr = h.to(dout.dtype.element_ty).to(CDT)
            a = dx * nw
            dnw_acc += dx * hr * rho
            dh = rho * a - (rho * rho * rho / D) * tl.sum(a * hr, axis=0) * hr
            c = tl.sum(dh * h, axis=0)  # sum_j p_j (dh . v_j)
            # Pass 2: dz_i = p_i (dh . v_i - c), dv_i = p_i dh + dz_i (r_i u - r_i^3 (u . v_i) v_i / D).
            for s0 in range(0, S, BLOCK_S):
                s_ok = s0 + offs_s < S
                ptr = tl.load(table + s0 + offs_s, mask=s_ok, other=0).to(tl.pointer_type(first.dtype.element_ty))
                ptr = tl.multiple_of(ptr, ALIGN)
                mask = s_ok[:, None] & d_ok[None, :]
                slot = (s0 + offs_s).to(tl.int64)[:, None] * M * D + base + offs_d[None, :]
                v = tl.load(ptr[:, None] + base + offs_d[None, :], mask=mask, other=0.0).to(CDT)
                r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
                dot_u = tl.sum(v * u[None, :], axis=1)
                p = tl.where(s_ok, tl.exp(dot_u * r - lse), 0.0)
                dz = p * (tl.sum(v * dh[None, :], axis=1) - c)
                dv = p[:, None] * dh[None, :] + (dz * r)[:, None] * u[None, :]
                dv -= (dz * r * r * r * dot_u / D)[:, None] * v
                tl.store(dsrc + slot, dv.to(dsrc.dtype.element_ty), mask=mask)
                du_acc += tl.sum((dz * r)[:, None] * v, axis=0)
        tl.store(du_part + pid * D + offs_d, du_acc, mask=d_ok)
        tl.store(dnw_part + pid * D + offs_d, dnw_acc, mask=d_ok)

    @triton.jit
    def _param_grads_kernel(
        du_part,  # [P, D] partial sums of dL/du
        dnw_part,  # [P, D] partial sums of dL/d norm_weight
        query,  # [D]
        key_w,  # [D]
        grads,  # [3, D]: d query = du * key_w, d key_w = du * query, d norm_weight
        P,
        D,
        BLOCK_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        offs_p = tl.arange(0, BLOCK_P)
        du = tl.zeros([BLOCK_D], du_part.dtype.element_ty)
        dnw = tl.zeros([BLOCK_D], du_part.dtype.element_ty)
        for p0 in range(0, P, BLOCK_P):
            mask = (p0 + offs_p < P)[:, None] & d_ok[None, :]
            at = (p0 + offs_p)[:, None] * D + offs_d[None, :]
            du += tl.sum(tl.load(du_part + at, mask=mask, other=0.0), axis=0)
            dnw += tl.sum(tl.load(dnw_part + at, mask=mask, other=0.0), axis=0)
        w = tl.load(query + offs_d, mask=d_ok, other=0.0).to(du.dtype)
        gamma = tl.load(key_w + offs_d, mask=d_ok, other=0.0).to(du.dtype)
        out_ty = grads.dtype.element_ty
        tl.store(grads + offs_d, (du * gamma).to(out_ty), mask=d_ok)
        tl.store(grads + D + offs_d, (du * w).to(out_ty), mask=d_ok)
        tl.store(grads + 2 * D + offs_d, dnw.to(out_ty), mask=d_ok)


def full_fwd(sources, query, key_weight, norm_weight, eps, norm_eps, save_h=False, save_logits=False):
    """sources: S x [..., D] contiguous, one dtype and shape -> (x [..., D] in that dtype, stats [2, ...] in the
    compute dtype: lse, then rho), or with `save_h` (x, h, h_res, stats), h [..., D] the mixture rounded to that
    dtype and h_res its rounding residual, int8 [..., D] for half sources (`rows.residual_scale`), empty otherwise;
    with `save_logits` also the logits z [S, ...] in the compute dtype, last."""
    s0 = sources[0]
    D = s0.shape[-1]
    M = s0.numel() // D if D else 0
    cdt = compute_dtype(s0)
    out = torch.empty_like(s0)
    h = torch.empty_like(s0) if save_h else out
    res_scale = residual_scale(s0.dtype) if save_h else 0.0
    h_res = torch.empty(s0.shape if res_scale else (0,), device=s0.device, dtype=torch.int8)
    stats = torch.empty(2, *s0.shape[:-1], device=s0.device, dtype=cdt)
    S = len(sources)
    logits = torch.empty(S, *s0.shape[:-1], device=s0.device, dtype=cdt) if save_logits else stats
    if M > 0:
        _full_fwd_kernel[(M,)](
            pointer_table(sources),
            s0,
            query,
            key_weight,
            norm_weight,
            out,
            h,
            h_res,
            stats,
            logits,
            M,
            S,
            D,
            *split_scalar(eps),
            *split_scalar(norm_eps),
            source_bucket(S),
            SAVE_H=save_h,
            SAVE_Z=save_logits,
            RES_SCALE=res_scale,
            CDT=compute_tl_dtype(cdt),
            ALIGN=table_alignment(sources),
            BLOCK_D=block_d(D),
        )
    result = (out, h, h_res, stats) if save_h else (out, stats)
    return (*result, logits) if save_logits else result


def full_bwd(dout, sources, query, key_weight, norm_weight, stats, eps):
    """-> (the gradients of the sources [S, ..., D] in their dtype, [3, D] in the query's dtype: the gradients of
    query, key_weight and norm_weight)."""
    s0 = sources[0]
    S, D = len(sources), s0.shape[-1]
    M = s0.numel() // D if D else 0
    cdt = stats.dtype
    programs = row_programs(M, s0.device, FULL_BWD_PROGRAMS_PER_SM)
    part = torch.empty(2, programs, D, device=s0.device, dtype=cdt)
    grads = torch.empty(3, D, device=s0.device, dtype=query.dtype)
    dsrc = torch.empty(S, *s0.shape, device=s0.device, dtype=s0.dtype)
    if M == 0:
        return dsrc, grads.zero_()
    _full_bwd_kernel[(programs,)](
        pointer_table(sources),
        s0,
        query,
        key_weight,
        norm_weight,
        dout,
        stats,
        dsrc,
        part[0],
        part[1],
        M,
        S,
        D,
        *split_scalar(eps),
        source_bucket(S),
        CDT=compute_tl_dtype(cdt),
        ALIGN=table_alignment(sources),
        BLOCK_D=block_d(D),
    )
    bd = min(PARAM_BLOCK, block_d(D))
    _param_grads_kernel[(-(-D // bd),)](
        part[0], part[1], query, key_weight, grads, programs, D, BLOCK_P=PARAM_ROWS, BLOCK_D=bd, num_warps=4
    )
    return dsrc, grads
