"""Fused one-token append to the MLA latent cache: RMSNorm of the latent, the row [c ; k_s] and its write at the
position each sequence's length counts, in one Triton kernel (docs/kernels.md, "MLA decode kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.triton_support import as_rows


@triton.jit
def _append_kernel(
    kv_ptr,  # [B, d_c] latent before its norm (stride stride_kv), activation dtype
    ks_ptr,  # [B, d_s] shared key part (stride stride_ks)
    w_ptr,  # [d_c] RMSNorm weight
    rows_ptr,  # [B, max_len, d_c + d_s], or a page pool [P, PAGE, d_c + d_s]
    lengths_ptr,  # [B] int32, counting the new token
    table_ptr,  # [B, max_len // PAGE] int32 page table (read only when PAGE > 0)
    stride_kv,
    stride_ks,
    stride_rb,  # of a sequence's rows, or of a page when PAGE > 0
    stride_rn,
    stride_tb,
    max_len,
    eps,
    DC: tl.constexpr,
    DS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PAGE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(lengths_ptr + b) - 1
    in_range = (pos >= 0) & (pos < max_len)  # a bad length writes nothing
    if PAGE > 0:
        page = tl.load(table_ptr + b * stride_tb + tl.where(in_range, pos, 0) // PAGE)
        row = rows_ptr + page.to(tl.int64) * stride_rb + (pos % PAGE).to(tl.int64) * stride_rn
    else:
        row = rows_ptr + b * stride_rb + pos.to(tl.int64) * stride_rn
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = (offs_c < DC) & (offs_c * 0 + in_range.to(tl.int32) > 0)
    x = tl.load(kv_ptr + b * stride_kv + offs_c, mask=offs_c < DC, other=0.0)
    xf = x.to(tl.float32)
    c = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / DC + eps) * tl.load(w_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(row + offs_c, c.to(x.dtype).to(rows_ptr.dtype.element_ty), mask=c_ok)
    if DS > 0:
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = (offs_s < DS) & (offs_s * 0 + in_range.to(tl.int32) > 0)
        ks = tl.load(ks_ptr + b * stride_ks + offs_s, mask=s_ok, other=0.0)
        tl.store(row + DC + offs_s, ks.to(rows_ptr.dtype.element_ty), mask=s_ok)


def append_latent_row(
    kv: torch.Tensor,
    k_shared: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    page_table: torch.Tensor | None = None,
) -> None:
    """Write one token per sequence into the latent cache, in place, at position lengths[b] - 1.

    Args:
        kv: [B, 1, d_c] latent projection W_DKV x (before the norm); k_shared: [B, 1, d_s] (d_s may be 0).
        norm_weight: [d_c] weight of the latent RMSNorm, eps its epsilon.
        rows: [B, max_len, d_c + d_s] the cache rows (last-dim stride 1); lengths: int32 [B], already counting
            the new token (not changed here).
        page_table: None, or int32 [B, pages] (unit last stride): rows is then a page pool [P, page_size, d_c + d_s]
            and position n of sequence b is row n % page_size of page page_table[b, n // page_size].
    """
    B, _, d_c = kv.shape
    d_s = k_shared.shape[-1]
    paged = page_table is not None
    if paged and (page_table.dtype != torch.int32 or page_table.shape[0] != B or page_table.stride(-1) != 1):
        raise ValueError(
            f"append_latent_row: page_table must be int32 [B={B}, pages] with unit last stride, got "
            f"{page_table.dtype} {tuple(page_table.shape)}"
        )
    if (rows.shape[0] != B and not paged) or rows.shape[-1] != d_c + d_s or rows.stride(-1) != 1:
        raise ValueError(
            f"append_latent_row: rows must be [B={B}, max_len, {d_c + d_s}] with unit last stride, "
            f"got {tuple(rows.shape)} strides {rows.stride()}"
        )
    if kv.shape[1] != 1 or k_shared.shape[:2] != (B, 1) or lengths.shape != (B,) or lengths.dtype != torch.int32:
        raise ValueError(
            f"append_latent_row: expected kv [B, 1, d_c], k_shared [B, 1, d_s], int32 lengths [B]; got "
            f"{tuple(kv.shape)}, {tuple(k_shared.shape)}, {lengths.dtype} {tuple(lengths.shape)}"
        )
    kv2 = as_rows(kv, d_c)
    ks2 = as_rows(k_shared, d_s) if d_s > 0 else kv2
    table = page_table if paged else lengths  # a placeholder the kernel never reads
    _append_kernel[(B,)](
        kv2,
        ks2,
        norm_weight,
        rows,
        lengths,
        table,
        kv2.stride(0),
        ks2.stride(0),
        rows.stride(0),
        rows.stride(1),
        table.stride(0),
        page_table.shape[1] * rows.shape[1] if paged else rows.shape[1],
        float(eps),
        DC=d_c,
        DS=d_s,
        BLOCK_C=triton.next_power_of_2(d_c),
        BLOCK_S=triton.next_power_of_2(max(d_s, 1)),
        PAGE=rows.shape[1] if paged else 0,
        num_warps=4,
    )
