"""`chunk_kda(..., return_chunk_states=True)`: the state at the start of every chunk, as prefix caching stores it.

    states  [B, NT, H, K, V]           NT = ceil(T / chunk_size)
            [1, NT_total, H, K, V]     with cu_seqlens: sequence n owns rows off[n] : off[n + 1], where off is the
                                       running sum of ceil(len_m / chunk_size) (an empty sequence owns none)

the layout of FLA's `return_intermediate_states`. Row j of a sequence is the state before its token j * chunk_size
(row 0 is the initial state). The states are float32 (float64 for float64 inputs), ready to be an `initial_state`,
and carry no gradient: they are a cache, and the outputs stay differentiable.

    torch   `naive_chunk_kda(..., return_chunk_states=True)`: the state the chunkwise loop carries, recorded at
            the start of each chunk (the outputs are those of the plain call)
    triton  `chunk_kda_triton(..., return_chunk_states=True)`: the states the forward's state pass already stores for
            the backward (`h` in chunk_fwd.py), kept in the input dtype: for 16-bit inputs they are the state rounded
            as the kernels' products read it
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.common import sequence_bounds


def chunk_count(cu_seqlens: torch.Tensor, chunk_size: int) -> int:
    """Rows of the packed chunk-state layout: sum over the sequences of ceil(length / chunk_size) (one host sync)."""
    return sum(-(-(e - s) // chunk_size) for s, e in sequence_bounds(cu_seqlens))
