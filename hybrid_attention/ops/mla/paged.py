"""Absorbed MLA attention over a paged latent cache (`paged_mla_decode`: the flash-decoding kernel reading each row
through the page table, beside `naive_paged_mla_decode`, which gathers the pages) and the write of new rows into
pages. Token n of sequence b is row n % page_size of page page_table[b, n // page_size] (docs/inference.md).
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.backends import check_backend
from hybrid_attention.ops.mla.decode import decode_backend
from hybrid_attention.ops.mla.naive import naive_absorbed_attention


def gather_pages(pool: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """The rows of every sequence in order: pool [P, page_size, D], page_table int [B, pages] -> [B, pages *
    page_size, D] (a copy; rows past a sequence's length are whatever its table points to)."""
    B, pages = page_table.shape
    index = page_table.long().flatten().clamp(0, pool.shape[0] - 1)  # entries past a sequence's pages are never read
    return pool[index].view(B, pages * pool.shape[1], pool.shape[2])


def naive_paged_mla_decode(
    q: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, *, value_dim: int, scale
) -> torch.Tensor:
    """The reference: gather each sequence's pages into contiguous rows, then `naive.absorbed_attention`.
    q [B, Tq, H, D] -> [B, Tq, H, value_dim] in q.dtype (fp32 math, fp64 for fp64 inputs)."""
    rows = gather_pages(pool, page_table)
    return naive_absorbed_attention(q, rows, value_dim=value_dim, scale=scale, causal=True, seq_lens=seq_lens)


def _check_inputs(q, pool, page_table, seq_lens, value_dim, scale) -> None:
    """Raise ValueError naming what is wrong (never syncs with a GPU: values are checked on the CPU only)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or min(q.shape) < 1:
        raise ValueError(f"paged_mla_decode: q must be a non-empty [B, Tq, H, D], got {tuple(getattr(q, 'shape', ()))}")
    B, Tq, _, D = q.shape
    if not isinstance(pool, torch.Tensor) or pool.dim() != 3 or pool.shape[2] != D or pool.stride(-1) != 1:
        raise ValueError(
            f"paged_mla_decode: pool must be [P, page_size, D={D}] with unit last stride, got "
            f"{tuple(getattr(pool, 'shape', ()))}"
        )
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2:
        raise ValueError("paged_mla_decode: page_table must be an int32 tensor [B, pages]")
    if page_table.shape[0] != B or page_table.stride(-1) != 1:
        raise ValueError(
            f"paged_mla_decode: page_table must be [B={B}, pages] with unit last stride, got {tuple(page_table.shape)}"
        )
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.shape != (B,):
        raise ValueError(f"paged_mla_decode: seq_lens must be an int32 tensor [B={B}]")
    if not q.is_floating_point() or q.dtype != pool.dtype:
        raise ValueError(f"paged_mla_decode: q and pool must share one floating dtype, got {q.dtype} and {pool.dtype}")
    if len({q.device, pool.device, page_table.device, seq_lens.device}) != 1:
        raise ValueError("paged_mla_decode: q, pool, page_table and seq_lens must be on one device")
    if isinstance(value_dim, bool) or not isinstance(value_dim, int) or not 1 <= value_dim <= D:
        raise ValueError(f"paged_mla_decode: value_dim must be an int in [1, D={D}], got {value_dim!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 < float(scale) < float("inf"):
        raise ValueError(f"paged_mla_decode: scale must be a positive finite number, got {scale!r}")
    if seq_lens.device.type == "cpu":  # free to check here; on a GPU it would need a host sync
        reach = page_table.shape[1] * pool.shape[1]
        if bool(((seq_lens < Tq) | (seq_lens > reach)).any()):
            raise ValueError(f"paged_mla_decode: seq_lens must lie in [Tq={Tq}, {reach}], got {seq_lens.tolist()}")
        used = torch.arange(page_table.shape[1])[None, :] * pool.shape[1] < seq_lens[:, None].long()
        pages = page_table[used]
        if pages.numel() and not (0 <= int(pages.min()) and int(pages.max()) < pool.shape[0]):
            raise ValueError(f"paged_mla_decode: a page table entry in use lies outside the pool's {pool.shape[0]}")


def paged_mla_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    num_splits: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of Tq absorbed queries per sequence over its latent rows, read through its page table.

    Args:
        q: [B, Tq, H, D] absorbed queries (D = d_c + d_s), the last Tq tokens of each sequence.
        pool: [P, page_size, D] the pages of one MLA layer (unit last stride).
        page_table: int32 [B, pages]: sequence b's token n lives in page page_table[b, n // page_size].
        seq_lens: int32 [B], each in [Tq, pages * page_size]; only the first seq_lens[b] tokens are read.
        value_dim, scale, num_splits, backend: as in `ops.mla.decode.mla_decode` ("torch": the reference,
            differentiable; "triton": the kernel, inference only; "auto": the rule of `ops.backends`).

    Returns:
        [B, Tq, H, value_dim] in q.dtype.
    """
    check_backend(backend, "paged_mla_decode")
    _check_inputs(q, pool, page_table, seq_lens, value_dim, scale)
    if decode_backend(backend, q, pool, "paged_mla_decode") == "torch":
        return naive_paged_mla_decode(q, pool, page_table, seq_lens, value_dim=value_dim, scale=scale)
    from hybrid_attention.ops.mla.triton_decode import mla_decode_triton

    return mla_decode_triton(
        q, pool, seq_lens, value_dim=value_dim, scale=scale, num_splits=num_splits, page_table=page_table
    )


def write_paged_rows(pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> None:
    """Write rows [B, T, D] as the last T tokens of each sequence (positions lengths[b] - T + t, the lengths already
    counting them) into their pages, in place. Positions are computed on the device (graph safe, no sync); a
    position below 0 is written to page_table[b, 0] (padding rows of a batch point there at a page nobody reads)."""
    B, T, D = rows.shape
    page_size = pool.shape[1]
    pos = (lengths.long()[:, None] - T + torch.arange(T, device=pool.device)).clamp(min=0)  # (B, T)
    pages = page_table.long().gather(1, pos // page_size)  # (B, T)
    flat = (pages * page_size + pos % page_size).flatten()
    pool.view(-1, D).index_copy_(0, flat, rows.reshape(B * T, D).to(pool.dtype))
