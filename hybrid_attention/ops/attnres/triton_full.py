"""Full AttnRes fused with the next sublayer's RMSNorm, for training: forward and backward Triton kernels.

    z_i = r_i (u . v_i),  r_i = rsqrt(mean(v_i^2) + eps),  u = w * gamma      (docs/math.md, "Attention Residuals")
    h = sum_i softmax_i(z) v_i,   x = norm_weight * h * rho,   rho = rsqrt(mean(h^2) + norm_eps)

The sources are separate [M, D] tensors read through a pointer table (`rows.pointer_table`), never stacked. The
forward keeps two numbers per row, lse = logsumexp(z) and rho; the backward recomputes z, p and h from the
sources (docs/math.md, "AttnRes backward"): pass 1 rebuilds h, pass 2 writes every source's gradient and sums
u's. One program per row in the forward; in the backward each program loops over rows so that the gradients of
u and of the norm weight are summed in registers, one partial row per program.
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.rows import block_d, compute_tl_dtype, pointer_table, row_programs, split_scalar

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

TILE = 4096  # elements of one [BLOCK_S, BLOCK_D] source tile: 4 sources of 1024 at a time


if triton is not None:

    @triton.jit
    def folded_query(query, key_w, offs_d, d_ok, CDT: tl.constexpr):
        """u = w * gamma in the compute dtype, zero past D: the key-norm weight folded into the pseudo-query."""
        w = tl.load(query + offs_d, mask=d_ok, other=0.0).to(CDT)
        return w * tl.load(key_w + offs_d, mask=d_ok, other=0.0).to(CDT)

    @triton.jit
    def _full_fwd_kernel(
        table,  # int64 [S]: data pointers of the S sources, each [M, D] contiguous
        first,  # source 0 (its element type is the sources')
        query,  # [D]
        key_w,  # [D]
        norm_w,  # [D]
        out,  # [M, D], the sources' dtype
        lse_ptr,  # [M] compute dtype
        rho_ptr,  # [M] compute dtype
        S,
        D,
        eps,
        eps_lo,
        norm_eps,
        norm_eps_lo,
        CDT: tl.constexpr,
        BLOCK_S: tl.constexpr,
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
        for s0 in range(0, S, BLOCK_S):
            s_ok = s0 + offs_s < S
            ptr = tl.load(table + s0 + offs_s, mask=s_ok, other=0).to(tl.pointer_type(first.dtype.element_ty))
            v = tl.load(ptr[:, None] + row * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            v = v.to(CDT)
            z = tl.sum(v * u[None, :], axis=1) * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
            z = tl.where(s_ok, z, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(z, axis=0))
            rescale = tl.exp(run_max - new_max)  # 0 on the first chunk
            p = tl.exp(z - new_max)
            run_sum = run_sum * rescale + tl.sum(p, axis=0)
            acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
            run_max = new_max
        # h is rounded to the output dtype before the norm, as the unfused composition does.
        h = (acc / run_sum).to(out.dtype.element_ty).to(CDT)
        rho = tl.rsqrt(tl.sum(h * h, axis=0) / D + norm_eps)
        nw = tl.load(norm_w + offs_d, mask=d_ok, other=0.0).to(CDT)
        tl.store(out + row * D + offs_d, (h * rho * nw).to(out.dtype.element_ty), mask=d_ok)
        tl.store(lse_ptr + row, run_max + tl.log(run_sum))
        tl.store(rho_ptr + row, rho)

    @triton.jit
    def _full_bwd_kernel(
        table,  # int64 [S] source pointers, as in the forward
        first,
        query,
        key_w,
        norm_w,
        dout,  # [M, D] gradient of the output (the sources' dtype)
        lse_ptr,  # [M]
        rho_ptr,  # [M]
        dsrc,  # [S, M, D] gradients of the sources (the sources' dtype)
        du_part,  # [programs, D] partial sums of dL/du
        dnw_part,  # [programs, D] partial sums of dL/d norm_weight
        M,
        S,
        D,
        eps,
        eps_lo,
        CDT: tl.constexpr,
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
            lse = tl.load(lse_ptr + row).to(CDT)
            rho = tl.load(rho_ptr + row).to(CDT)
            dx = tl.load(dout + base + offs_d, mask=d_ok, other=0.0).to(CDT)
            # Pass 1: h = sum_i p_i v_i from the saved lse.
            h = tl.zeros([BLOCK_D], CDT)
            for s0 in range(0, S, BLOCK_S):
                s_ok = s0 + offs_s < S
                ptr = tl.load(table + s0 + offs_s, mask=s_ok, other=0).to(tl.pointer_type(first.dtype.element_ty))
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
                mask = s_ok[:, None] & d_ok[None, :]
                v = tl.load(ptr[:, None] + base + offs_d[None, :], mask=mask, other=0.0).to(CDT)
                r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
                dot_u = tl.sum(v * u[None, :], axis=1)
                p = tl.where(s_ok, tl.exp(dot_u * r - lse), 0.0)
                dz = p * (tl.sum(v * dh[None, :], axis=1) - c)
                dv = p[:, None] * dh[None, :] + (dz * r)[:, None] * u[None, :]
                dv -= (dz * r * r * r * dot_u / D)[:, None] * v
                slot = (s0 + offs_s).to(tl.int64)[:, None] * M * D + base + offs_d[None, :]
                tl.store(dsrc + slot, dv.to(dsrc.dtype.element_ty), mask=mask)
                du_acc += tl.sum((dz * r)[:, None] * v, axis=0)
        tl.store(du_part + pid * D + offs_d, du_acc, mask=d_ok)
        tl.store(dnw_part + pid * D + offs_d, dnw_acc, mask=d_ok)


def _launch_shape(S: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_D, num_warps): whole rows, a few sources per tile. 4 warps up to D = 1024 both ways: the
    backward holds several rows' worth of registers, and 8 warps halve how many programs an SM keeps in flight."""
    bd = block_d(D)
    bs = max(1, min(triton.next_power_of_2(S), TILE // bd))
    return bs, bd, 4 if bd <= 1024 else 8


def full_fwd(sources, query, key_weight, norm_weight, eps, norm_eps):
    """sources: S x [M, D] contiguous, one dtype -> (x [M, D] in that dtype, lse [M], rho [M] in compute dtype)."""
    S, (M, D) = len(sources), sources[0].shape
    cdt = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    out = torch.empty_like(sources[0])
    lse = torch.empty(M, device=out.device, dtype=cdt)
    rho = torch.empty(M, device=out.device, dtype=cdt)
    if M == 0:
        return out, lse, rho
    bs, bd, warps = _launch_shape(S, D)
    _full_fwd_kernel[(M,)](
        pointer_table(sources), sources[0], query, key_weight, norm_weight, out, lse, rho, S, D,
        *split_scalar(eps), *split_scalar(norm_eps), CDT=compute_tl_dtype(out.dtype), BLOCK_S=bs, BLOCK_D=bd,
        num_warps=warps,
    )  # fmt: skip
    return out, lse, rho


def full_bwd(dout, sources, query, key_weight, norm_weight, lse, rho, eps):
    """-> (d sources [S, M, D] in the sources' dtype, du [D] = dL/d(query * key_weight), d norm_weight [D]);
    du and d norm_weight in the compute dtype."""
    S, (M, D) = len(sources), sources[0].shape
    dsrc = torch.empty(S, M, D, device=dout.device, dtype=sources[0].dtype)
    programs = row_programs(M, dout.device)
    du = torch.empty(programs, D, device=dout.device, dtype=lse.dtype)
    dnw = torch.empty(programs, D, device=dout.device, dtype=lse.dtype)
    if M > 0:
        bs, bd, warps = _launch_shape(S, D)
        _full_bwd_kernel[(programs,)](
            pointer_table(sources), sources[0], query, key_weight, norm_weight, dout, lse, rho, dsrc, du, dnw,
            M, S, D, *split_scalar(eps), CDT=compute_tl_dtype(lse.dtype), BLOCK_S=bs, BLOCK_D=bd,
            num_warps=warps,
        )  # fmt: skip
    return dsrc, du.sum(0), dnw.sum(0)
