"""The layout of `chunk_kda(..., return_chunk_states=True)`, the state at the start of every chunk
(docs/kernels.md, "The KDA ops").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.common import sequence_bounds


def chunk_count(cu_seqlens: torch.Tensor, chunk_size: int) -> int:
    """Rows of the packed chunk-state layout: sum over the sequences of ceil(length / chunk_size) (one host sync)."""
    return sum(-(-(e - s) // chunk_size) for s, e in sequence_bounds(cu_seqlens))
