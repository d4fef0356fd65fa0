"""Readers of a cached MLA prefix, tile by tile: `reader(start, stop)` returns the latent rows [c ; k_s] of tokens
[start, stop) of every sequence, [B, stop - start, d_c + d_s]. `mla_prefill` asks for the tiles it needs, so the
prefix can live in one contiguous cache or in fixed-size pages, and is never gathered whole."""

from __future__ import annotations

from collections.abc import Callable

import torch

PrefixReader = Callable[[int, int], torch.Tensor]


def contiguous_prefix(rows: torch.Tensor) -> PrefixReader:
    """Reader of a contiguous cache rows [B, max_len, D]: each tile is a view, nothing is copied."""
    if rows.ndim != 3:
        raise ValueError(f"contiguous_prefix: rows must be [B, max_len, D], got shape {tuple(rows.shape)}")

    def read(start: int, stop: int) -> torch.Tensor:
        return rows[:, start:stop]

    return read


def paged_prefix(pages: torch.Tensor, page_table: torch.Tensor) -> PrefixReader:
    """Reader of a paged cache: pages [num_pages, page_size, D] of latent rows, page_table [B, pages_per_seq] (int,
    on the pages' device): token t of sequence b is row t % page_size of page page_table[b, t // page_size].

    A tile gathers the pages it overlaps (one index_select on the device, no host sync) and drops the rows before
    `start` and after `stop`: [B, stop - start, D], a fresh tensor.
    """
    if pages.ndim != 3 or page_table.ndim != 2 or page_table.is_floating_point():
        raise ValueError(
            f"paged_prefix: expected pages [num_pages, page_size, D] and an integer page_table [B, pages_per_seq], "
            f"got {tuple(pages.shape)} and {page_table.dtype} {tuple(page_table.shape)}"
        )
    if page_table.device != pages.device:
        raise ValueError(f"paged_prefix: page_table is on {page_table.device}, pages on {pages.device}")
    B = page_table.shape[0]
    page_size, width = pages.shape[1:]

    def read(start: int, stop: int) -> torch.Tensor:
        first, last = start // page_size, -(-stop // page_size)
        if last > page_table.shape[1]:
            raise ValueError(
                f"paged_prefix: tokens up to {stop} need {last} pages, the table has {page_table.shape[1]}"
            )
        ids = page_table[:, first:last].reshape(-1).long()
        tile = pages.index_select(0, ids).view(B, (last - first) * page_size, width)
        return tile[:, start - first * page_size : stop - first * page_size]

    return read
