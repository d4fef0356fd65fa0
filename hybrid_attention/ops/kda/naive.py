"""Reference Kimi Delta Attention in plain PyTorch: the recurrence (ground truth) and the chunkwise form, the spec the
Triton kernels are tested against (docs/math.md, "KDA recurrence" and "Chunkwise form").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_attention.ops.kda.common import (
    check_values,
    resolve_scale,
    sequence_bounds,
    validate_chunk_size,
    validate_kda_inputs,
)
from hybrid_attention.ops.numerics import compute_dtype

Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time: the ground truth.

    Args:
        q, k: [B, T, H, K] (L2-normalised by the caller).  v: [B, T, H, V].
        g: [B, T, H, K] natural-log decay per key channel.  beta: [B, T, H].
        scale: defaults to K ** -0.5.
        initial_state: [N, H, K, V] float32 (or float64 with float64 inputs); zeros when None.
        output_final_state: return the state after the last token.
        cu_seqlens: int [N + 1]; packs N sequences along T of a batch of one (B == 1).
    Returns:
        o [B, T, H, V] in v.dtype, and the final state [N, H, K, V] (float32/float64) or None.
    """
    N = validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, name="recurrent_kda")
    (qc, kc, vc, gc, bc), S0, scale = _prepare(q, k, v, g, beta, initial_state, N, scale, "recurrent_kda")
    with torch.autocast(q.device.type, enabled=False):  # autocast would run the matmuls in half precision
        o, S = _per_sequence(lambda *x: _recurrent(*x, scale=scale), qc, kc, vc, gc, bc, S0, cu_seqlens)
    return o.to(v.dtype), (S if output_final_state else None)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    return_chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """KDA in chunks of `chunk_size` tokens (docs/math.md, "Chunkwise form"); same arguments and results as
    `recurrent_kda`. Any T works (the last chunk is zero-padded internally); chunk_size is 16, 32 or 64.
    Differentiable by plain autograd. Memory grows as T * chunk_size * K per head (the pairwise decays):
    this is the readable reference, not the fast path.

    return_chunk_states: also return the state at the start of every chunk, without gradient, in the layout of
    chunk_states.py: [B, NT, H, K, V], or [1, NT_total, H, K, V] with cu_seqlens."""
    N = validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, name="chunk_kda")
    validate_chunk_size(chunk_size, name="chunk_kda")
    (qc, kc, vc, gc, bc), S0, scale = _prepare(q, k, v, g, beta, initial_state, N, scale, "chunk_kda")
    states = [] if return_chunk_states else None
    core = lambda *x: _chunkwise(*x, scale=scale, chunk_size=chunk_size, states=states)
    with torch.autocast(q.device.type, enabled=False):  # autocast would run the matmuls in half precision
        o, S = _per_sequence(core, qc, kc, vc, gc, bc, S0, cu_seqlens)
    o, S = o.to(v.dtype), (S if output_final_state else None)
    if not return_chunk_states:
        return o, S
    if cu_seqlens is None:
        return o, S, torch.stack(states, dim=1)  # NT x [B, H, K, V] -> [B, NT, H, K, V]
    return o, S, torch.cat(states, dim=0).unsqueeze(0)  # NT_total x [1, H, K, V] -> [1, NT_total, H, K, V]


def _prepare(q, k, v, g, beta, initial_state, N, scale, name):
    """Cast to the compute dtype, default the scale, and build the start state [N, H, K, V]."""
    dtype = compute_dtype(q)
    _, _, H, K = q.shape
    V = v.shape[-1]
    scale = resolve_scale(scale, K, name=name)
    check_values(g, beta, name=name)
    if initial_state is None:
        S0 = torch.zeros(N, H, K, V, dtype=dtype, device=q.device)
    else:
        S0 = initial_state.to(dtype)
    return [x.to(dtype) for x in (q, k, v, g, beta)], S0, scale


def _per_sequence(core: Core, q, k, v, g, beta, S0, cu_seqlens):
    """Run `core` on the whole batch, or once per packed sequence (B == 1), each with its own state row."""
    if cu_seqlens is None:
        return core(q, k, v, g, beta, S0)
    outputs, states = [], []
    for n, (s, e) in enumerate(sequence_bounds(cu_seqlens)):
        if s == e:  # an empty sequence has no output and keeps its state
            states.append(S0[n : n + 1])
            continue
        o_n, S_n = core(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S0[n : n + 1])
        outputs.append(o_n)
        states.append(S_n)
    return torch.cat(outputs, dim=1), torch.cat(states, dim=0)


def _recurrent(q, k, v, g, beta, S, *, scale: float):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; S [B, H, K, V] -> o [B, T, H, V], S."""
    outputs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)  # S <- Diag(alpha_t) S: decay the rows (key channels)
        v_new = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t].unsqueeze(-1) * v_new.unsqueeze(-2)  # S <- S + beta_t k_t (v_t - S^T k_t)^T
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # o_t = scale * S_t^T q_t
    return torch.stack(outputs, dim=1), S


def _pairwise_log_decay(g: torch.Tensor) -> torch.Tensor:
    """g [..., C, K] -> L [..., C, C, K] with L[t, i] = G_t - G_i = sum_{i < s <= t} g_s for i <= t, -inf for i > t.

    Summing g over (i, t] directly, rather than subtracting two cumulative sums, keeps L exact when g holds
    very negative values (g = -1000 on padding would otherwise cancel catastrophically). The -inf above the
    diagonal is put in the exponent, so exp(L) is exactly 0 there and its gradient is 0, never inf * 0.
    """
    C = g.shape[-2]
    ones = torch.ones(C, C, dtype=torch.bool, device=g.device)
    strictly_below = ones.tril(-1)[:, :, None]  # [t, i, 1]: t > i
    x = g.unsqueeze(-2).expand(*g.shape[:-1], C, g.shape[-1])  # x[t, i] = g_t
    L = x.masked_fill(~strictly_below, 0.0).cumsum(dim=-3)  # sum over s <= t of g_s [s > i]
    return L.masked_fill(~ones.tril()[:, :, None], float("-inf"))


def _chunkwise(q, k, v, g, beta, S, *, scale: float, chunk_size: int, states: list | None = None):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; S [B, H, K, V] -> o [B, T, H, V], S.
    `states`, when a list, receives the state at the start of each chunk (detached).

    The chunk-local quantities (A, T, U, W) are computed for all chunks at once; only the state is
    carried from chunk to chunk (D, O, S_C), as in docs/math.md.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = -(-T // C)
    pad = NT * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # Zero padding at the end is inert: g = 0 keeps the state, k = beta = 0 adds nothing to it,
        # and the padded outputs are dropped. [B, T, H, *] -> [B, H, NT, C, *]
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
        return x.view(B, NT, C, H, *x.shape[3:]).movedim(3, 1)

    q, k, v, g = (to_chunks(x) for x in (q, k, v, g))  # [B, H, NT, C, K] (v: [..., V])
    beta = to_chunks(beta)  # [B, H, NT, C]

    # From the first token with a non-finite k, v, g or beta on, a chunk's outputs and the state after it are not
    # finite (as in the recurrence). The products by lower triangular matrices below take zeros in those rows and
    # put NaN back afterwards, so that 0 * NaN never carries a later row's NaN into an earlier row.
    # g = -inf is a valid decay (exp(g) = 0 erases the state): only NaN and +inf there count.
    finite = torch.isfinite(k.sum(-1) + v.sum(-1) + beta) & (g.sum(-1) < float("inf"))  # [B, H, NT, C]
    bad = (~finite).cumsum(-1).bool().unsqueeze(-1)  # at or after the first non-finite row

    def causal(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """m @ x for a lower triangular m, earlier rows never touched by later non-finite rows of x."""
        return (m @ x.masked_fill(bad, 0.0)).masked_fill(bad, float("nan"))

    G = g.cumsum(dim=-2)  # G_t = sum_{s <= t in chunk} g_s, inclusive
    decay = _pairwise_log_decay(g).exp()  # exp(G_t - G_i) for i <= t, 0 above: [B, H, NT, C, C, K]
    q_tilde = q * G.exp()  # q~_t = q_t * exp(G_t)   (G <= 0: safe)
    k_tilde = k * G.exp()  # k~_t = k_t * exp(G_t)
    # k^_i = k_i * exp(-G_i) is never formed on its own (it can reach e^320); only the pairwise products are:
    # A_ti = k~_t . k^_i = sum_c k_tc exp(G_tc - G_ic) k_ic for i < t (strictly lower triangular).
    A = torch.einsum("...tc,...tic,...ic->...ti", k, decay, k).tril(-1)
    # (Q~ K^^T masked to i <= t), the intra-chunk attention of the output (masked: a later k may be non-finite).
    QK = torch.einsum("...tc,...tic,...ic->...ti", q, decay, k).tril()

    # Tm = T = (I + Diag(beta) A)^{-1} of docs/math.md: unit lower triangular, by a differentiable triangular solve.
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + beta.unsqueeze(-1) * A, eye, upper=False, unitriangular=True)
    U = causal(Tm, beta.unsqueeze(-1) * v)  # U = T Diag(beta) V   [B, H, NT, C, V]
    W = causal(Tm, beta.unsqueeze(-1) * k_tilde)  # W = T Diag(beta) K~   [B, H, NT, C, K]

    decay_last = G[..., -1, :].exp().unsqueeze(-1)  # exp(G_C): decay of the whole chunk [B, H, NT, K, 1]
    k_to_end = k * decay[..., -1, :, :]  # k_i * exp(G_C - G_i): key decayed to the chunk end [B, H, NT, C, K]

    outputs = []
    for n in range(NT):
        if states is not None:
            states.append(S.detach())
        D = U[:, :, n] - W[:, :, n] @ S  # D = U - W S0, the new values   [B, H, C, V]
        # O = scale * (Q~ S0 + (Q~ K^^T masked to i <= t) D)
        bad_n = bad[:, :, n]
        O = q_tilde[:, :, n] @ S + (QK[:, :, n] @ D.masked_fill(bad_n, 0.0)).masked_fill(bad_n, float("nan"))
        outputs.append(scale * O)
        # S_C = Diag(exp(G_C)) S0 + (K * exp(G_C - G))^T D
        S = decay_last[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ D
    o = torch.stack(outputs, dim=2).reshape(B, H, NT * C, V)[:, :, :T]
    return o.transpose(1, 2), S  # [B, T, H, V], [B, H, K, V]
