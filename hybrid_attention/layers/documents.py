"""Packed documents: several documents back to back in one row [1, T], cut by `cu_seqlens` as FLA's varlen API takes
them; `PackedDocuments` is what the mixers read (docs/training.md, "Packed documents").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedDocuments:
    cu_seqlens: torch.Tensor  # int32 [N + 1] on the tokens' device
    max_len: int  # the longest document
    positions: torch.Tensor  # int32 [1, T]: each token's position in its document

    @property
    def num_documents(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor | PackedDocuments, total: int, device: torch.device) -> PackedDocuments:
        """Check `cu_seqlens` (int [N + 1], non-decreasing from 0 to `total`; any device) and derive the rest.
        A PackedDocuments passes through."""
        if isinstance(cu_seqlens, PackedDocuments):
            return cu_seqlens
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be an int32 or int64 tensor [N + 1], got {cu_seqlens!r:.80}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        host = cu_seqlens.tolist()  # no sync for a CPU tensor
        lengths = [b - a for a, b in itertools.pairwise(host)]
        if host[0] != 0 or host[-1] != total or min(lengths) < 0:
            raise ValueError(
                f"cu_seqlens must rise from 0 to the {total} tokens, got {host[:8]}{'...' * (len(host) > 8)}"
            )
        cu = cu_seqlens.to(torch.int32)
        if cu.device != device:
            cu = cu.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else cu.to(device)
        first = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)  # each token's document start
        positions = (torch.arange(total, device=device, dtype=torch.int32) - first).view(1, total)
        return cls(cu, max(lengths), positions)


def packed_documents(
    layer: str, cu_seqlens: torch.Tensor | PackedDocuments | None, x: torch.Tensor, cache
) -> PackedDocuments | None:
    """The documents a mixer's input x [1, T, hidden] packs (None without cu_seqlens); packing needs B == 1, and
    no cache or one that takes packed documents (`packs_documents`: each document the first chunk of a sequence,
    written into that sequence's cache). `layer` names the mixer in the error."""
    packs = getattr(cache, "packs_documents", False)
    if cu_seqlens is None:
        if packs:
            raise ValueError(f"{layer}: a cache that takes packed documents needs cu_seqlens")
        return None
    takes = cache is None or packs
    if x.shape[0] != 1 or not takes:
        raise ValueError(
            f"{layer}: cu_seqlens packs documents into B == 1 without a cache (or with one that takes packed "
            f"documents), got x of shape {tuple(x.shape)}{'' if takes else ' and a cache'}"
        )
    return PackedDocuments.of(cu_seqlens, x.shape[1], x.device)
