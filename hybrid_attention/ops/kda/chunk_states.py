"""`chunk_kda(..., return_chunk_states=True)`: the state at the start of every chunk, as prefix caching stores it.

    states  [B, NT, H, K, V]           NT = ceil(T / chunk_size)
            [1, NT_total, H, K, V]     with cu_seqlens: sequence n owns rows off[n] : off[n + 1], where off is the
                                       running sum of ceil(len_m / chunk_size) (an empty sequence owns none)

the layout of FLA's `return_intermediate_states`. Row j of a sequence is the state before its token j * chunk_size
(row 0 is the initial state). The states are float32 (float64 for float64 inputs), ready to be an `initial_state`,
and carry no gradient: they are a cache, and the outputs stay differentiable.

    torch   `chunk_kda_torch` one chunk at a time, each call starting from the state the previous one returned
            (the same arithmetic as the whole-sequence call, which carries the state from chunk to chunk too)
    triton  `chunk_kda_triton(..., return_chunk_states=True)`: the states the forward's state pass already stores for
            the backward (`h` in chunk_fwd.py), kept in the input dtype: for 16-bit inputs they are the state rounded
            as the kernels' products read it
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.kda.common import sequence_bounds, validate_chunk_size, validate_kda_inputs
from hybrid_attention.ops.kda.naive import chunk_kda_torch
from hybrid_attention.ops.numerics import compute_dtype


def chunk_count(cu_seqlens: torch.Tensor, chunk_size: int) -> int:
    """Rows of the packed chunk-state layout: sum over the sequences of ceil(length / chunk_size) (one host sync)."""
    return sum(-(-(e - s) // chunk_size) for s, e in sequence_bounds(cu_seqlens))


def chunk_states_torch(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The PyTorch reference with its chunk states: arguments and (o, final state) as `chunk_kda_torch`, plus the
    states in the layout of the module docstring."""
    N = validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, name="chunk_kda")
    validate_chunk_size(chunk_size, name="chunk_kda")
    B, T, H, K = q.shape
    S0 = initial_state
    if S0 is None:
        S0 = torch.zeros(N, H, K, v.shape[-1], dtype=compute_dtype(q), device=q.device)
    # (token range, start state) of each independent run: the whole batch, or one packed sequence.
    bounds = [(0, T)] if cu_seqlens is None else sequence_bounds(cu_seqlens)
    outputs, states, finals = [], [], []
    for n, (s, e) in enumerate(bounds):
        S = S0 if cu_seqlens is None else S0[n : n + 1]
        for t in range(s, e, chunk_size):
            u = min(t + chunk_size, e)
            states.append(S.detach().to(compute_dtype(q)))
            o, S = chunk_kda_torch(
                q[:, t:u], k[:, t:u], v[:, t:u], g[:, t:u], beta[:, t:u], scale=scale,
                initial_state=S, output_final_state=True, chunk_size=chunk_size,
            )  # fmt: skip
            outputs.append(o)
        finals.append(S)
    o = torch.cat(outputs, dim=1)
    if cu_seqlens is None:
        states = torch.stack(states, dim=1)  # NT x [B, H, K, V] -> [B, NT, H, K, V]
    else:
        states = torch.cat(states, dim=0).unsqueeze(0)  # NT_total x [1, H, K, V] -> [1, NT_total, H, K, V]
    final = torch.cat([S.to(compute_dtype(q)) for S in finals], dim=0)
    return o, (final if output_final_state else None), states
