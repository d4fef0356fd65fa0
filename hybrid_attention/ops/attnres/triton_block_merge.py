"""Block AttnRes for training, phase 2: the merge of a sublayer's own block's partial sum with phase 1's attention over
the completed blocks, fused with its RMSNorm; forward and backward Triton kernels (docs/kernels.md, "Phase 2").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.rows import block_d, tile_warps, tuned_over_row_blocks
from hybrid_attention.ops.triton_support import compute_tl_dtype, row_programs, split_scalar

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

# (BLOCK_M, num_warps) of the backward; one-warp rows reduce without shared memory and fit more per SM
MERGE_BWD_CONFIGS = [(1, 4), (1, 2), (1, 1), (2, 1), (2, 2), (2, 8), (2, 4), (4, 8)]


if triton is not None:
    from hybrid_attention.ops.attnres.rows import rms_norm_bwd_rows, row_block
    from hybrid_attention.ops.attnres.triton_mix_norm import folded_query

    @triton.jit
    def _merge_norm_fwd_kernel(
        out,  # [M, D] phase-1 output for this sublayer
        lse_ptr,  # [M] compute dtype
        partial,  # [M, D] the block's partial sum (HAS_PARTIAL only)
        query,  # [D]
        key_w,  # [D]
        norm_w,  # [D]
        x_ptr,  # [M, D] the result, in its own dtype
        rho_ptr,  # [M] compute dtype
        D,
        eps,
        eps_lo,
        norm_eps,
        norm_eps_lo,
        HAS_PARTIAL: tl.constexpr,
        CDT: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        norm_eps = tl.cast(norm_eps, CDT) + tl.cast(norm_eps_lo, CDT)
        row = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        h = tl.load(out + row * D + offs_d, mask=d_ok, other=0.0).to(CDT)
        if HAS_PARTIAL:
            P = tl.load(partial + row * D + offs_d, mask=d_ok, other=0.0).to(CDT)
            u = folded_query(query, key_w, offs_d, d_ok, CDT)
            s = tl.sum(u * P, axis=0) * tl.rsqrt(tl.sum(P * P, axis=0) / D + eps)
            alpha = 1.0 / (1.0 + tl.exp(tl.load(lse_ptr + row).to(CDT) - s))
            h = h + alpha * (P - h)
        hr = h.to(x_ptr.dtype.element_ty).to(CDT)  # rounded before the norm, as the unfused composition does
        rho = tl.rsqrt(tl.sum(hr * hr, axis=0) / D + norm_eps)
        nw = tl.load(norm_w + offs_d, mask=d_ok, other=0.0).to(CDT)
        tl.store(x_ptr + row * D + offs_d, (hr * rho * nw).to(x_ptr.dtype.element_ty), mask=d_ok)
        tl.store(rho_ptr + row, rho)

    # (BLOCK_M, num_warps); the first is the one the interpreter runs.
    @tuned_over_row_blocks(
        [{"BLOCK_M": m, "num_warps": w} for m, w in MERGE_BWD_CONFIGS],
        key=["D", "HAS_PARTIAL"],
    )
    @triton.jit
    def _merge_norm_bwd_kernel(
        out,  # [M, D] phase-1 output
        lse_ptr,  # [M] compute dtype
        partial,  # [M, D] (HAS_PARTIAL only)
        query,
        key_w,
        norm_w,
        rho_ptr,  # [M]
        dx_ptr,  # [M, D] gradient of the result
        dout,  # [M, D] gradient of `out`, in out's dtype
        dlse,  # [M] (HAS_PARTIAL only)
        dpartial,  # [M, D] (HAS_PARTIAL only), the partial sum's dtype
        du_part,  # [programs, D] (HAS_PARTIAL only)
        dnw_part,  # [programs, D]
        M,
        D,
        eps,
        eps_lo,
        HAS_PARTIAL: tl.constexpr,
        CDT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        u = folded_query(query, key_w, offs_d, d_ok, CDT)
        nw = tl.load(norm_w + offs_d, mask=d_ok, other=0.0).to(CDT)
        # Per-row partial sums, added over the rows once at the end (no reduction per block of rows).
        du_acc = tl.zeros([BLOCK_M, BLOCK_D], CDT)
        dnw_acc = tl.zeros([BLOCK_M, BLOCK_D], CDT)
        for m0 in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rm, m_ok, at, mask = row_block(m0, offs_m, offs_d, d_ok, M, D)  # rows past M add nothing to the sums
            o = tl.load(out + at, mask=mask, other=0.0).to(CDT)
            h = o
            if HAS_PARTIAL:
                P = tl.load(partial + at, mask=mask, other=0.0).to(CDT)
                r = tl.rsqrt(tl.sum(P * P, axis=1) / D + eps)
                dot_u = tl.sum(P * u[None, :], axis=1)
                alpha = 1.0 / (1.0 + tl.exp(tl.load(lse_ptr + rm, mask=m_ok, other=0.0).to(CDT) - dot_u * r))
                h = o + alpha[:, None] * (P - o)
            hr = h.to(dx_ptr.dtype.element_ty).to(CDT)
            rho = tl.load(rho_ptr + rm, mask=m_ok, other=0.0).to(CDT)
            dx = tl.load(dx_ptr + at, mask=mask, other=0.0).to(CDT)
            dh, dnw_rows = rms_norm_bwd_rows(dx, hr, rho, nw, D)
            dnw_acc += dnw_rows
            if HAS_PARTIAL:
                # d out = (1 - alpha) dh, dt = (dh . (P - out)) alpha (1 - alpha) with t = s - lse.
                tl.store(dout + at, ((1.0 - alpha)[:, None] * dh).to(dout.dtype.element_ty), mask=mask)
                dt = tl.sum(dh * (P - o), axis=1) * alpha * (1.0 - alpha)
                tl.store(dlse + rm, -dt, mask=m_ok)
                dtr = dt * r
                dp = alpha[:, None] * dh + dtr[:, None] * u[None, :] - (dtr * r * r * dot_u / D)[:, None] * P
                tl.store(dpartial + at, dp.to(dpartial.dtype.element_ty), mask=mask)
                du_acc += dtr[:, None] * P
            else:
                tl.store(dout + at, dh.to(dout.dtype.element_ty), mask=mask)
        if HAS_PARTIAL:
            tl.store(du_part + pid * D + offs_d, tl.sum(du_acc, axis=0), mask=d_ok)
        tl.store(dnw_part + pid * D + offs_d, tl.sum(dnw_acc, axis=0), mask=d_ok)


def merge_norm_fwd(out, lse, partial, query, key_weight, norm_weight, eps, norm_eps, dtype):
    """out [M, D], lse [M] (compute dtype), partial [M, D] or None -> (x [M, D] in `dtype`, rho [M] in lse's
    dtype)."""
    M, D = out.shape
    x = torch.empty(M, D, device=out.device, dtype=dtype)
    rho = torch.empty(M, device=out.device, dtype=lse.dtype)
    if M > 0:
        bd = block_d(D)
        _merge_norm_fwd_kernel[(M,)](
            out,
            lse,
            partial if partial is not None else out,
            query,
            key_weight,
            norm_weight,
            x,
            rho,
            D,
            *split_scalar(eps),
            *split_scalar(norm_eps),
            HAS_PARTIAL=partial is not None,
            CDT=compute_tl_dtype(lse.dtype),
            BLOCK_D=bd,
            num_warps=tile_warps(bd),
        )
    return x, rho


def merge_norm_bwd(dx, out, lse, partial, query, key_weight, norm_weight, rho, eps):
    """-> (d out [M, D], d lse [M], d partial [M, D] or None, du [D] or None, d norm_weight [D])."""
    M, D = out.shape
    has_partial = partial is not None
    dout = torch.empty_like(out)
    dlse = torch.empty_like(lse) if has_partial else None
    dpartial = torch.empty_like(partial) if has_partial else None
    programs = row_programs(M, out.device)
    du = torch.empty(programs, D, device=out.device, dtype=lse.dtype)
    dnw = torch.empty(programs, D, device=out.device, dtype=lse.dtype)
    if M > 0:
        _merge_norm_bwd_kernel[(programs,)](
            out,
            lse,
            partial if has_partial else out,
            query,
            key_weight,
            norm_weight,
            rho,
            dx,
            dout,
            dlse if has_partial else lse,
            dpartial if has_partial else out,
            du,
            dnw,
            M,
            D,
            *split_scalar(eps),
            HAS_PARTIAL=has_partial,
            CDT=compute_tl_dtype(lse.dtype),
            BLOCK_D=block_d(D),
        )
    return dout, dlse, dpartial, du.sum(0) if has_partial else None, dnw.sum(0)
