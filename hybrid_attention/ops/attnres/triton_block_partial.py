"""Block AttnRes for training, phase 1: the Triton kernels, forward and backward, of the attention of all of a block's
sublayers over the completed block sums (docs/kernels.md, "Phase 1").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.rows import (
    MAX_TILE,
    block_d,
    pointer_table,
    table_alignment,
    tile_warps,
    tuned_over_configs,
)
from hybrid_attention.ops.numerics import compute_dtype
from hybrid_attention.ops.triton_support import compute_tl_dtype, next_power_of_2, row_programs, split_scalar

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

PARTIAL_BWD_BLOCKS = 8  # most blocks the phase-1 backward holds in one tile; past it, one block row at a time
PARTIAL_BWD_WARPS = [4, 8]  # num_warps of the phase-1 backward


if triton is not None:

    @triton.jit
    def _block_row(table, k, at, d_ok, ELEM: tl.constexpr, CDT: tl.constexpr, ALIGN: tl.constexpr):
        """Block k's row at the offsets `at` [BLOCK_D], read through the pointer table, in the compute dtype."""
        ptr = tl.multiple_of(tl.load(table + k).to(tl.pointer_type(ELEM)), ALIGN)
        return tl.load(ptr + at, mask=d_ok, other=0.0).to(CDT)

    @triton.jit
    def _partial_fwd_kernel(
        table,  # int64 [N]: data pointers of the N completed blocks, each [M, D] contiguous
        first,  # block 0 (its element type is the blocks')
        queries,  # [Q, D]
        key_ws,  # [Q, D]
        out_table,  # int64 [Q]: data pointers of the Q outputs, each [M, D] contiguous in the blocks' dtype
        lse_ptr,  # [Q, M] compute dtype
        N,
        Q,
        M,
        D,
        eps,
        eps_lo,
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        row = tl.program_id(0).to(tl.int64)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q_ok = offs_q < Q
        qd = offs_q[:, None] * D + offs_d[None, :]
        qd_ok = q_ok[:, None] & d_ok[None, :]
        u = tl.load(queries + qd, mask=qd_ok, other=0.0).to(CDT) * tl.load(key_ws + qd, mask=qd_ok, other=0.0).to(CDT)
        run_max = tl.full([BLOCK_Q], float("-inf"), CDT)
        run_sum = tl.zeros([BLOCK_Q], CDT)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], CDT)
        elem = first.dtype.element_ty
        for k in range(0, N):
            b = _block_row(table, k, row * D + offs_d, d_ok, elem, CDT, ALIGN)
            z = tl.sum(u * b[None, :], axis=1) * tl.rsqrt(tl.sum(b * b, axis=0) / D + eps)
            new_max = tl.maximum(run_max, z)
            rescale = tl.exp(run_max - new_max)  # 0 for the first block
            p = tl.exp(z - new_max)
            run_sum = run_sum * rescale + p
            acc = acc * rescale[:, None] + p[:, None] * b[None, :]
            run_max = new_max
        out = tl.multiple_of(tl.load(out_table + offs_q, mask=q_ok, other=0).to(tl.pointer_type(elem)), ALIGN)
        tl.store(out[:, None] + row * D + offs_d[None, :], (acc / run_sum[:, None]).to(elem), mask=qd_ok)
        tl.store(lse_ptr + offs_q.to(tl.int64) * M + row, run_max + tl.log(run_sum), mask=q_ok)

    @triton.jit
    def _blocks_tile(table, N, base, offs_n, offs_d, d_ok, ELEM: tl.constexpr, CDT: tl.constexpr, ALIGN: tl.constexpr):
        """The N blocks at the row offset `base`, gathered through the pointer table into one [BLOCK_N, BLOCK_D]
        tile in the compute dtype (zero past N); -> (tile, which of its rows are blocks)."""
        n_ok = offs_n < N
        ptrs = tl.multiple_of(tl.load(table + offs_n, mask=n_ok, other=0).to(tl.pointer_type(ELEM)), ALIGN)
        b = tl.load(ptrs[:, None] + base + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        return b.to(CDT), n_ok

    @triton.jit
    def _query_rows(
        folded, dout_table, q, D, base, offs_d, d_ok, ELEM: tl.constexpr, CDT: tl.constexpr, ALIGN: tl.constexpr
    ):
        """Query q's u_q and the row of dout_q at `base`, both [BLOCK_D] in the compute dtype."""
        u = tl.load(folded + q * D + offs_d, mask=d_ok, other=0.0)
        dout = tl.multiple_of(tl.load(dout_table + q).to(tl.pointer_type(ELEM)), ALIGN)
        return u, tl.load(dout + base + offs_d, mask=d_ok, other=0.0).to(CDT)

    @triton.jit
    def _query_dots(b, r, n_ok, u, do, lse):
        """u_q . b_k, dout_q . b_k and p_qk for the blocks of the tile b [BLOCK_N, BLOCK_D], each [BLOCK_N] (p is
        zero past N)."""
        dot_u = tl.sum(b * u[None, :], axis=1)
        dot_do = tl.sum(b * do[None, :], axis=1)
        return dot_u, dot_do, tl.where(n_ok, tl.exp(dot_u * r - lse), 0.0)

    @triton.jit
    def _query_grads(b, r, u, do, dot_u, dot_do, p, c, dl, db, s, du, is_q):
        """Query q's share of the tile's gradients, with dz_qk = p_qk (dout_q . b_k - c_q + dlse_q):
        db [BLOCK_N, BLOCK_D] += p dout_q + dz r u_q, s [BLOCK_N] += dz r (u_q . b_k) (the norm term, applied once
        all queries are in), and row q of du [BLOCK_Q, BLOCK_D] (`is_q`) += sum_k dz_qk r_k b_k."""
        dzr = p * (dot_do - c + dl) * r
        db += p[:, None] * do[None, :] + dzr[:, None] * u[None, :]
        du += tl.where(is_q[:, None], tl.sum(dzr[:, None] * b, axis=0)[None, :], 0.0)
        return db, s + dzr * dot_u, du

    @triton.jit
    def _store_block_grads(dblk, n_ok, b, r, db, s, M, D, base, offs_n, offs_d, d_ok):
        """d b_k = db - (r^3 / D) (sum_q dz (u_q . b_k)) b_k for the tile's blocks, one 2-D store."""
        db -= (r * r / D * s)[:, None] * b
        slots = offs_n.to(tl.int64) * M * D  # int64: N * M * D may pass 2^31
        at = slots[:, None] + base + offs_d[None, :]
        tl.store(dblk + at, db.to(dblk.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])

    # num_warps; the first is the one the interpreter runs. With 4 warps the blocks' axis of the tile stays within each
    # thread, so the sums over blocks need no shared memory.
    @tuned_over_configs([{"num_warps": w} for w in PARTIAL_BWD_WARPS], key=["D", "BLOCK_N", "BLOCK_Q"])
    @triton.jit
    def _partial_bwd_kernel(
        table,  # int64 [N] block pointers, as in the forward
        first,
        folded,  # [Q, D] u_q = w_q * gamma_q in the compute dtype (one load per use instead of two)
        lse_ptr,  # [Q, M]
        dout_table,  # int64 [Q]: the gradients of the Q outputs, each [M, D] contiguous in the blocks' dtype
        dlse,  # [Q, M] the gradient of lse
        dblk,  # [N, M, D] gradients of the blocks (the blocks' dtype)
        du_part,  # [programs, Q, D] partial sums of dL/du_q
        N,
        Q,
        M,
        D,
        eps,
        eps_lo,
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_N: tl.constexpr,  # next_power_of_2(N) <= PARTIAL_BWD_BLOCKS: every block in one tile
        BLOCK_Q: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        pid = tl.program_id(0)
        offs_n = tl.arange(0, BLOCK_N)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        elem = first.dtype.element_ty
        du = tl.zeros([BLOCK_Q, BLOCK_D], CDT)
        for row in range(pid, M, tl.num_programs(0)):
            row64 = tl.zeros([], tl.int64) + row  # int64 offsets (the interpreter's row is an int)
            base = row64 * D
            # Every block in one tile, read once: per query, its dot products give c_q and then its gradients.
            b, n_ok = _blocks_tile(table, N, base, offs_n, offs_d, d_ok, elem, CDT, ALIGN)
            r = tl.rsqrt(tl.sum(b * b, axis=1) / D + eps)
            db = tl.zeros([BLOCK_N, BLOCK_D], CDT)
            s = tl.zeros([BLOCK_N], CDT)
            for q in tl.static_range(BLOCK_Q):
                if q < Q:  # a branch per query: its loads wait for it, holding fewer registers
                    u, do = _query_rows(folded, dout_table, q, D, base, offs_d, d_ok, elem, CDT, ALIGN)
                    lse = tl.load(lse_ptr + q * M + row64).to(CDT)
                    dl = tl.load(dlse + q * M + row64).to(CDT)
                    dot_u, dot_do, p = _query_dots(b, r, n_ok, u, do, lse)
                    c = tl.sum(p * dot_do, axis=0)
                    db, s, du = _query_grads(b, r, u, do, dot_u, dot_do, p, c, dl, db, s, du, offs_q == q)
            _store_block_grads(dblk, n_ok, b, r, db, s, M, D, base, offs_n, offs_d, d_ok)
        qd = offs_q[:, None] * D + offs_d[None, :]
        tl.store(du_part + pid * Q * D + qd, du, mask=(offs_q < Q)[:, None] & d_ok[None, :])

    # More blocks than one tile holds: one block row at a time, in two passes over them (the first sums c_q and keeps
    # each block's dot products in [BLOCK_N, BLOCK_Q] tiles, the second re-reads the rows, from the cache, for the
    # gradients).
    @triton.jit
    def _partial_bwd_rows_kernel(
        table,  # int64 [N] block pointers, as in the forward
        first,
        folded,  # [Q, D] u_q = w_q * gamma_q in the compute dtype
        lse_ptr,  # [Q, M]
        dout_table,  # int64 [Q]: the gradients of the Q outputs, each [M, D] contiguous in the blocks' dtype
        dlse,  # [Q, M] the gradient of lse
        dblk,  # [N, M, D] gradients of the blocks (the blocks' dtype)
        du_part,  # [programs, Q, D] partial sums of dL/du_q
        N,
        Q,
        M,
        D,
        eps,
        eps_lo,
        CDT: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        eps = tl.cast(eps, CDT) + tl.cast(eps_lo, CDT)
        pid = tl.program_id(0)
        offs_n = tl.arange(0, BLOCK_N)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q_ok = offs_q < Q
        qd = offs_q[:, None] * D + offs_d[None, :]
        qd_ok = q_ok[:, None] & d_ok[None, :]
        u = tl.load(folded + qd, mask=qd_ok, other=0.0)
        elem = first.dtype.element_ty
        dout = tl.multiple_of(tl.load(dout_table + offs_q, mask=q_ok, other=0).to(tl.pointer_type(elem)), ALIGN)
        du_acc = tl.zeros([BLOCK_Q, BLOCK_D], CDT)
        for row in range(pid, M, tl.num_programs(0)):
            base = (tl.zeros([], tl.int64) + row) * D  # int64 offsets (the interpreter's row is an int)
            q_rows = offs_q.to(tl.int64) * M + row
            do = tl.load(dout[:, None] + base + offs_d[None, :], mask=qd_ok, other=0.0).to(CDT)
            lse = tl.load(lse_ptr + q_rows, mask=q_ok, other=0.0).to(CDT)
            dl = tl.load(dlse + q_rows, mask=q_ok, other=0.0).to(CDT)
            # Pass 1: c_q = sum_k p_qk (dout_q . b_k) = dout_q . out_q from the blocks (the stored out_q is
            # rounded), keeping each block's dot products in [BLOCK_N, BLOCK_Q] tiles for pass 2, which then only
            # re-reads b_k (from the cache) for the gradients.
            dots_u = tl.zeros([BLOCK_N, BLOCK_Q], CDT)
            dots_do = tl.zeros([BLOCK_N, BLOCK_Q], CDT)
            rs = tl.zeros([BLOCK_N], CDT)
            c = tl.zeros([BLOCK_Q], CDT)
            for k in range(0, N):
                b = _block_row(table, k, base + offs_d, d_ok, elem, CDT, ALIGN)
                r = tl.rsqrt(tl.sum(b * b, axis=0) / D + eps)
                dot_u = tl.sum(u * b[None, :], axis=1)
                dot_do = tl.sum(do * b[None, :], axis=1)
                c += tl.where(q_ok, tl.exp(dot_u * r - lse), 0.0) * dot_do
                is_k = offs_n == k
                dots_u = tl.where(is_k[:, None], dot_u[None, :], dots_u)
                dots_do = tl.where(is_k[:, None], dot_do[None, :], dots_do)
                rs = tl.where(is_k, r, rs)
            for k in range(0, N):
                b = _block_row(table, k, base + offs_d, d_ok, elem, CDT, ALIGN)
                is_k = offs_n == k
                r = tl.sum(tl.where(is_k, rs, 0.0), axis=0)
                dot_u = tl.sum(tl.where(is_k[:, None], dots_u, 0.0), axis=0)
                p = tl.where(q_ok, tl.exp(dot_u * r - lse), 0.0)
                # dz_qk = p_qk (dout_q . b_k - c_q + dlse_q)
                # db_k = sum_q p_qk dout_q + dz_qk (r u_q - r^3 (u_q . b_k) b_k / D)
                dz = p * (tl.sum(tl.where(is_k[:, None], dots_do, 0.0), axis=0) - c + dl)
                db = tl.sum(p[:, None] * do + (dz * r)[:, None] * u, axis=0)
                db -= (r * r * r / D) * tl.sum(dz * dot_u, axis=0) * b
                slot = tl.full([], 0, tl.int64) + k  # int64: N * M * D may pass 2^31
                tl.store(dblk + slot * M * D + base + offs_d, db.to(dblk.dtype.element_ty), mask=d_ok)
                du_acc += (dz * r)[:, None] * b[None, :]
        tl.store(du_part + pid * Q * D + qd, du_acc, mask=qd_ok)


def partial_fwd(blocks, queries, key_weights, eps):
    """blocks: N x [M, D] contiguous, one dtype; queries, key_weights [Q, D] -> (out: Q x [M, D] in the blocks'
    dtype, lse [Q, M] in the compute dtype)."""
    N, (M, D), Q = len(blocks), blocks[0].shape, queries.shape[0]
    cdt = compute_dtype(blocks[0])
    out = [torch.empty(M, D, device=blocks[0].device, dtype=blocks[0].dtype) for _ in range(Q)]
    lse = torch.empty(Q, M, device=blocks[0].device, dtype=cdt)
    if M > 0:
        bq, bd = next_power_of_2(Q), block_d(D)
        _partial_fwd_kernel[(M,)](
            pointer_table(blocks),
            blocks[0],
            queries,
            key_weights,
            pointer_table(out),
            lse,
            N,
            Q,
            M,
            D,
            *split_scalar(eps),
            CDT=compute_tl_dtype(cdt),
            ALIGN=table_alignment([*blocks, *out]),
            BLOCK_Q=bq,
            BLOCK_D=bd,
            num_warps=tile_warps(bq * bd),
        )
    return out, lse


def partial_bwd(dout, dlse, blocks, queries, key_weights, lse, eps):
    """dout: Q x [M, D] contiguous in the blocks' dtype; dlse, lse [Q, M] in the compute dtype
    -> (d blocks [N, M, D] in the blocks' dtype, du [Q, D] = dL/d(queries * key_weights) in compute dtype)."""
    N, (M, D), Q = len(blocks), blocks[0].shape, queries.shape[0]
    device = blocks[0].device
    dblk = torch.empty(N, M, D, device=device, dtype=blocks[0].dtype)
    programs = row_programs(M, device)
    cdt = lse.dtype
    du = torch.empty(programs, Q, D, device=device, dtype=cdt)
    if M == 0:
        return dblk, du.sum(0)
    bn, bq, bd = next_power_of_2(N), next_power_of_2(Q), block_d(D)
    align = table_alignment([*blocks, *dout])
    common = dict(CDT=compute_tl_dtype(cdt), ALIGN=align, BLOCK_N=bn, BLOCK_Q=bq, BLOCK_D=bd)
    args = (
        pointer_table(blocks),
        blocks[0],
        queries.to(cdt) * key_weights.to(cdt),
        lse,
        pointer_table(dout),
        dlse,
        dblk,
        du,
        N,
        Q,
        M,
        D,
        *split_scalar(eps),
    )
    if bn <= min(PARTIAL_BWD_BLOCKS, MAX_TILE // bd):
        _partial_bwd_kernel[(programs,)](*args, **common)
    else:
        _partial_bwd_rows_kernel[(programs,)](*args, **common, num_warps=tile_warps(bq * bd))
    return dblk, du.sum(0)
