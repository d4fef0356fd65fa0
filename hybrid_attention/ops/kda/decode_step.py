"""One KDA decode step as serving engines call it, `kda_decode_step`: a pool of states addressed by indices, more value
heads than query/key heads, beta as logits, the reference as a backend (docs/kernels.md, "Decode step").
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybrid_attention.ops.backends import resolve
from hybrid_attention.ops.kda.common import l2_normalize
from hybrid_attention.ops.kda.gate import kda_gate
from hybrid_attention.ops.kda.naive import naive_recurrent_kda
from hybrid_attention.ops.kda.value_heads import repeat_qk_heads, value_head_groups
from hybrid_attention.ops.numerics import compute_dtype

_NAME = "kda_decode_step"


def kda_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    state_indices: Tensor | None = None,
    scale: float | None = None,
    gate: str | None = None,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    use_beta_sigmoid: bool = False,
    backend: str = "auto",
) -> Tensor:
    """Advance the states of B sequences by T tokens (T small) and return the tokens' outputs; inference only (runs
    without autograd).

    Args:
        q, k: [B, T, Hqk, K].  v: [B, T, Hv, V], Hv a multiple of Hqk.  g: [B, T, Hv, K] (the log decay, or with a
            gate the raw logits, as in `chunk_kda`).  beta: [B, T, Hv], or its logits with use_beta_sigmoid.
        state: [B, Hv, K, V] float32, updated in place; with state_indices a pool [P, Hv, K, V] float32 whose rows
            state_indices[b] are read and written (float64 states with float64 inputs on the "torch" backend).
        state_indices: int32/int64 [B] or None. Valid entries are distinct rows in [0, P); a negative entry is a
            padding slot: its outputs are 0 and no row is written for it.
        scale: defaults to K ** -0.5.  gate, A_log [Hv], dt_bias [Hv*K], lower_bound: as in `chunk_kda`.
        use_qk_l2norm: L2-normalise q and k first.  backend: "auto", "torch" or "triton" (see backends.py).
    Returns:
        o: [B, T, Hv, V] in v.dtype.
    """
    backend = resolve(backend, q, name=_NAME)
    groups = value_head_groups(q, k, v, name=_NAME)
    with torch.no_grad():
        q, k = repeat_qk_heads(q, k, groups)
        if use_beta_sigmoid:
            beta = torch.sigmoid(beta.to(compute_dtype(q)))
        step = lambda S: _step(backend, q, k, v, g, beta, S, scale, gate, A_log, dt_bias, lower_bound, use_qk_l2norm)
        if state_indices is None:
            o, new = step(state)
            if new is not state:
                state.copy_(new)
            return o
        _check_pool(state, state_indices, q, v)
        if backend == "triton":
            return _triton_step(
                q, k, v, g, beta, state, scale, gate, A_log, dt_bias, lower_bound, use_qk_l2norm, state_indices.long()
            )
        rows, valid, first = _pool_rows(state_indices)
        o, new = step(state.index_select(0, rows))
        # Padding slots write their anchor row's result: the first valid slot's new row, or (none valid) the row as
        # it was, so all writes to one row agree. Indexing by tensors throughout: no host sync.
        keep = state.index_select(0, rows.index_select(0, first))
        anchor = torch.where(valid.index_select(0, first).view(1, 1, 1, 1), new.index_select(0, first), keep)
        mask = valid.view(-1, 1, 1, 1)
        state.index_copy_(0, rows, torch.where(mask, new, anchor).to(state.dtype))
        return o.masked_fill(~mask, 0.0)


def _step(backend, q, k, v, g, beta, S, scale, gate, A_log, dt_bias, lower_bound, use_qk_l2norm):
    """(o, state after the tokens) from S [B, Hv, K, V]; the Triton step updates S in place and returns it."""
    if backend == "triton":
        S = S if S.is_contiguous() else S.contiguous()
        return _triton_step(q, k, v, g, beta, S, scale, gate, A_log, dt_bias, lower_bound, use_qk_l2norm), S
    if gate is not None:
        if A_log is None or dt_bias is None:
            raise ValueError(f"{_NAME}: gate={gate!r} needs A_log and dt_bias")
        g = kda_gate(g, A_log, dt_bias.reshape(-1), lower_bound, form=gate)
    elif A_log is not None or dt_bias is not None or lower_bound is not None:
        raise ValueError(f'{_NAME}: A_log, dt_bias and lower_bound need gate="bounded" or "softplus"')
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=S, output_final_state=True)


def _triton_step(q, k, v, g, beta, S, scale, gate, A_log, dt_bias, lower_bound, use_qk_l2norm, state_indices=None):
    """The fused Triton step on S (a batch of states, or a pool addressed by state_indices), updated in place."""
    from hybrid_attention.ops.kda.triton_step import fused_recurrent_kda_step

    return fused_recurrent_kda_step(
        q,
        k,
        v,
        g,
        beta,
        S,
        scale=scale,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm,
        state_indices=state_indices,
    )


def _check_pool(state: Tensor, idx: Tensor, q: Tensor, v: Tensor) -> None:
    """The pool [P, Hv, K, V] and its indices [B] (int32 or int64, on the pool's device) fit q and v."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{_NAME}: state_indices must be an int32 or int64 tensor, got {getattr(idx, 'dtype', idx)}")
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if B is None or tuple(v.shape[:1]) != (B,) or v.dim() != 4:
        raise ValueError(
            f"{_NAME}: q must be [B, T, Hqk, K] and v [B, T, Hv, V], got {tuple(q.shape)} and {tuple(v.shape)}"
        )
    if tuple(idx.shape) != (B,):
        raise ValueError(f"{_NAME}: state_indices must be [B] = [{B}] (one row per sequence), got {tuple(idx.shape)}")
    if idx.device != state.device:
        raise ValueError(f"{_NAME}: state_indices is on {idx.device} but state is on {state.device}")
    row = (v.shape[2], q.shape[3], v.shape[3])
    if not isinstance(state, torch.Tensor) or state.dim() != 4 or tuple(state.shape[1:]) != row:
        raise ValueError(
            f"{_NAME}: state must be a pool [P, Hv, K, V] = [P, {', '.join(map(str, row))}], "
            f"got {tuple(getattr(state, 'shape', ()))}"
        )


def _pool_rows(idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(row read by each slot [B], valid slots [B], first valid slot [1]) for the reference's gather; a padding slot
    reads the first valid slot's row (row 0 when none is valid)."""
    idx = idx.long()
    valid = idx >= 0
    first = valid.to(torch.uint8).argmax().view(1)  # slot 0 when none is valid
    rows = torch.where(valid, idx, idx[first].clamp(min=0))
    return rows, valid, first
