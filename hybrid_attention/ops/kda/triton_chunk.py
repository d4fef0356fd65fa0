"""Chunkwise KDA on our Triton kernels, `chunk_kda_triton`: differentiable, `torch.compile`-traceable through custom
ops, exact for any decay (docs/kernels.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybrid_attention.ops.kda.chunk_bwd import kda_bwd
from hybrid_attention.ops.kda.chunk_fwd import allocate_fwd, kda_fwd
from hybrid_attention.ops.kda.chunk_states import chunk_count
from hybrid_attention.ops.kda.common import resolve_scale, validate_chunk_size, validate_kda_inputs
from hybrid_attention.ops.kda.gate import FORM_CODES, FUSED_FORMS, check_gate
from hybrid_attention.ops.kda.triton_utils import CHUNK, MAX_DIM, MAX_TILE_SPAN, ChunkLayout, empty
from hybrid_attention.ops.triton_support import eager_or_traced, triton_runs_on

_SAVED = ("aqk", "tm", "akk", "glast", "rq", "rk", "h", "vnew", "fbad")
_NAME = "chunk_kda[triton]"
FwdOutputs = tuple[(Tensor,) * (2 + len(_SAVED))]  # o, final state, saved: the op's schema needs the count


def _forward(
    q, k, v, g, beta, initial_state, cu_seqlens, a_log, dt_bias, scale, lower_bound, gate, l2norm, final, save
):
    o, ht, saved = kda_fwd(
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        scale=scale,
        lower_bound=lower_bound,
        gate=gate,
        l2norm=l2norm,
        final=final,
        save=save,
    )
    return (o, ht, *(saved[name] for name in _SAVED))


@torch.library.custom_op("hybrid_attention::kda_chunk_fwd", mutates_args=())
def _fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    a_log: Tensor | None,
    dt_bias: Tensor | None,
    scale: float,
    lower_bound: float,
    gate: int,
    l2norm: bool,
    final: bool,
    save: bool,
) -> FwdOutputs:
    """(o, final state, *saved for the backward in _SAVED order)."""
    return _forward(
        q, k, v, g, beta, initial_state, cu_seqlens, a_log, dt_bias, scale, lower_bound, gate, l2norm, final, save
    )


@_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, a_log, dt_bias, scale, lower_bound, gate, l2norm, final, save):
    B, T = q.shape[:2]
    n_seq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    n_chunks = ChunkLayout.count(B, T, n_seq, cu_seqlens is not None)
    o, ht, saved = allocate_fwd(q, v, n_seq, n_chunks, final=final, save=save, l2norm=l2norm)
    return (o, ht, *(saved[name] for name in _SAVED))


def _backward_kernels(
    do, dht, q, k, v, g, beta, cu_seqlens, a_log, dt_bias, saved, scale, lower_bound, gate, l2norm, h0_needed
):
    saved = dict(zip(_SAVED, saved, strict=True))
    grads = kda_bwd(
        do,
        dht,
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        h0_needed,
        cu_seqlens,
        saved,
        scale=scale,
        lower_bound=lower_bound,
        gate=gate,
        l2norm=l2norm,
    )
    # Custom op outputs may not alias each other: the empty placeholders must be distinct tensors.
    return tuple(x if x.numel() else empty(x, 0) for x in grads)


@torch.library.custom_op("hybrid_attention::kda_chunk_bwd", mutates_args=())
def _bwd_op(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor | None,
    a_log: Tensor | None,
    dt_bias: Tensor | None,
    saved: list[Tensor],
    scale: float,
    lower_bound: float,
    gate: int,
    l2norm: bool,
    h0_needed: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, d initial_state, d A_log, d dt_bias); unused slots are empty tensors."""
    return _backward_kernels(
        do, dht, q, k, v, g, beta, cu_seqlens, a_log, dt_bias, saved, scale, lower_bound, gate, l2norm, h0_needed
    )


@_bwd_op.register_fake
def _(do, dht, q, k, v, g, beta, cu_seqlens, a_log, dt_bias, saved, scale, lower_bound, gate, l2norm, h0_needed):
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_seq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = torch.float32
    none = lambda: empty(q, 0, dtype=f32)
    dh0 = empty(q, n_seq, H, K, V, dtype=f32) if h0_needed else none()
    da_log = empty(q, H, dtype=f32) if gate else none()
    ddt = empty(q, H, K, dtype=f32) if gate else none()
    return (
        empty(q, *q.shape),
        empty(k, *k.shape),
        empty(v, *v.shape),
        empty(g, *g.shape),
        empty(beta, *beta.shape),
        dh0,
        da_log,
        ddt,
    )


_fwd_call = eager_or_traced(_fwd_op, _forward)
_bwd_call = eager_or_traced(_bwd_op, _backward_kernels)


class _ChunkKDA(torch.autograd.Function):
    """(o, final state, *saved in _SAVED order); the saved tensors are outputs too (the chunk states among them)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu_seqlens, a_log, dt_bias, scale, lower_bound, gate, l2norm, final, save):
        o, ht, *saved = _fwd_call(
            q, k, v, g, beta, h0, cu_seqlens, a_log, dt_bias, scale, lower_bound, gate, l2norm, final, save
        )
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, a_log, dt_bias, *saved)
        ctx.meta = (scale, lower_bound, gate, l2norm, h0 is not None, final, save)
        ctx.mark_non_differentiable(*saved)
        # Without this autograd would fill a zero gradient for every saved tensor (about 1 GB at 8 x 4096 x 16 x
        # 128): the backward takes None for outputs that got no gradient.
        ctx.set_materialize_grads(False)
        return o, ht, *saved

    @staticmethod
    def backward(ctx, do, dht, *_):
        scale, lower_bound, gate, l2norm, has_h0, final, save = ctx.meta
        if not save:
            raise RuntimeError(f"{_NAME}: backward through a forward that ran without saving its tensors")
        q, k, v, g, beta, cu_seqlens, a_log, dt_bias, *saved = ctx.saved_tensors
        if do is None:  # only the final state was used
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dbeta, dh0, da_log, ddt = _bwd_call(
            do,
            dht if final else None,
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens,
            a_log,
            dt_bias,
            saved,
            scale,
            lower_bound,
            gate,
            l2norm,
            has_h0,
        )
        if gate:
            da_log, ddt = da_log.to(a_log.dtype), ddt.to(dt_bias.dtype)
        else:
            da_log = ddt = None
        return (dq, dk, dv, dg, dbeta, dh0 if has_h0 else None, None, da_log, ddt) + (None,) * 6


def _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, gate, A_log, dt_bias, lower_bound):
    """Input checks: the shared KDA rules, then what these kernels support. Returns (gate code, lower_bound)."""
    if torch.compiler.is_compiling():  # the shared check reads cu_seqlens on the host, a graph break
        validate_kda_inputs(q, k, v, g, beta, initial_state if cu_seqlens is None else None, None, name=_NAME)
    else:
        validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, name=_NAME)
    validate_chunk_size(chunk_size, name=_NAME, allowed=(64,))
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_DIM or V > MAX_DIM:
        raise ValueError(f"{_NAME}: K and V must be <= {MAX_DIM}, got K = {K}, V = {V}")
    if CHUNK * v.shape[2] * max(K, V) >= MAX_TILE_SPAN:  # a chunk's tile offsets are int32 (triton_utils._row_base)
        most = (MAX_TILE_SPAN - 1) // (CHUNK * max(K, V))
        raise ValueError(f"{_NAME}: at most {most} heads at K = {K}, V = {V}, got {v.shape[2]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f'{_NAME}: supports float16, bfloat16 and float32 inputs, got {q.dtype}; use backend="torch"')
    if not triton_runs_on(q):
        raise ValueError(f"{_NAME}: needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {q.device}")
    if gate is None:
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            raise ValueError(f'{_NAME}: A_log, dt_bias and lower_bound need gate="bounded" or "softplus"')
        return 0, 0.0
    lb = check_gate(
        gate, A_log, dt_bias, lower_bound, H=q.shape[2], K=K, name=_NAME, device=q.device, allowed=FUSED_FORMS
    )
    return FORM_CODES[gate], lb


def chunk_kda_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    gate: str | None = None,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    return_chunk_states: bool = False,
) -> tuple[Tensor, ...]:
    """Chunkwise KDA on the Triton kernels; the same results as `recurrent_kda`.

    Args:
        q, k: [B, T, H, K], K <= 256 (normalised inside when use_qk_l2norm).  v: [B, T, H, V], V <= 256.
        g: [B, T, H, K] natural-log decay (gate None), or the raw gate logits z that the kernels turn into the decay
            of `kda_gate(z, A_log, dt_bias, lower_bound, form=gate)` (gate "bounded" or "softplus").
        beta: [B, T, H].  scale: defaults to K ** -0.5.
        initial_state: [N, H, K, V] float32.  output_final_state: also return the state after the last token.
        cu_seqlens: int [N + 1], N sequences packed along T with B == 1.  chunk_size: 64 (the only size).
        gate: None, "bounded" or "softplus".  A_log: [H].  dt_bias: [H*K] (or [H, K]).
        lower_bound: finite and < 0, "bounded" only (None: -5).
        use_qk_l2norm: L2-normalise q and k per head inside the kernels.
        return_chunk_states: also return the state at the start of every chunk, in the layout of chunk_states.py.
    Returns:
        o [B, T, H, V] in v.dtype, the final state [N, H, K, V] float32 or None, and with return_chunk_states the
        chunk states float32 [B, NT, H, K, V] (or [1, NT_total, H, K, V] with cu_seqlens).
    Inputs float16, bfloat16 or float32, on CUDA (or CPU under TRITON_INTERPRET=1). Differentiable in q, k, v,
    g (z), beta, initial_state, A_log and dt_bias.
    """
    gate, lb = _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, gate, A_log, dt_bias, lower_bound)
    H, K = q.shape[2], q.shape[3]
    scale = resolve_scale(scale, K, name=_NAME)
    dt = dt_bias.reshape(H, K) if gate else None
    inputs = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    # The chunk states are the `h` the forward saves for the backward: keep the saved tensors to return them.
    save = grad or return_chunk_states
    o, ht, *saved = _ChunkKDA.apply(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        cu_seqlens,
        A_log if gate else None,
        dt,
        scale,
        lb,
        gate,
        bool(use_qk_l2norm),
        bool(output_final_state),
        save,
    )
    ht = ht if output_final_state else None
    if not return_chunk_states:
        return o, ht
    h = saved[_SAVED.index("h")]  # [chunk slots, H, K, V], in the input dtype
    if cu_seqlens is None:
        states = h.view(q.shape[0], -(-q.shape[1] // chunk_size), H, K, v.shape[-1])
    else:  # varlen allocates an upper bound of chunk slots; the sequences' chunks come first, in order
        states = h[: chunk_count(cu_seqlens, chunk_size)].unsqueeze(0)
    # While training the backward reads the same buffer: hand out a copy, so writing into it cannot alter gradients.
    return o, ht, states.detach().to(torch.float32, copy=grad)
