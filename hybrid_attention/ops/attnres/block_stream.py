"""Differentiable fused Block AttnRes for training: phase 1 for all sublayers of a block (`attn_res_partial_train`) and
phase 2 fused with the RMSNorm that reads the mixture (`attn_res_merge_norm_train`); docs/kernels.md, "Attention
Residuals kernels".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybrid_attention.ops.attnres.rows import check_sources, check_vectors
from hybrid_attention.ops.attnres.triton_block_merge import merge_norm_bwd, merge_norm_fwd
from hybrid_attention.ops.attnres.triton_block_partial import partial_bwd, partial_fwd
from hybrid_attention.ops.numerics import compute_dtype
from hybrid_attention.ops.triton_support import eager_or_traced


def _flat(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.reshape(-1, t.shape[-1]) for t in tensors]


def _distinct_empty(like: Tensor) -> Tensor:
    # Custom op outputs may not alias each other: each placeholder is its own tensor.
    return like.new_empty(0)


# ------------------------------------------------------------------------------------------- Block AttnRes, phase 1
def _partial_forward(blocks, queries, key_weights, eps):
    shape, Q = blocks[0].shape, queries.shape[0]
    out, lse = partial_fwd(_flat(blocks), queries, key_weights, eps)
    return [o.view(shape) for o in out], lse.view(Q, *shape[:-1])


def _partial_backward_kernels(dout, dlse, blocks, queries, key_weights, lse, eps):
    shape, Q = blocks[0].shape, queries.shape[0]
    dblk, du = partial_bwd(
        _flat([d.contiguous() for d in dout]),
        dlse.contiguous().view(Q, -1),
        _flat(blocks),
        queries,
        key_weights,
        lse.view(Q, -1),
        eps,
    )
    return dblk.view(len(blocks), *shape), du


# The Q outputs are separate tensors, not one [Q, ..., D]: each sublayer's phase 2 reads one and its backward returns
# that one's gradient, which the phase-1 backward reads where it lies (a stacked output would have autograd copy the
# Q gradients into one tensor first).
@torch.library.custom_op("hybrid_attention::attn_res_partial_fwd", mutates_args=())
def _partial_fwd_op(
    blocks: list[Tensor], queries: Tensor, key_weights: Tensor, eps: float
) -> tuple[list[Tensor], Tensor]:
    """(out: Q x [..., D] in the blocks' dtype, lse [Q, ...] in the compute dtype)."""
    return _partial_forward(blocks, queries, key_weights, eps)


@_partial_fwd_op.register_fake
def _(blocks, queries, key_weights, eps):
    b0, Q = blocks[0], queries.shape[0]
    cdt = compute_dtype(b0)
    return [b0.new_empty(b0.shape) for _ in range(Q)], b0.new_empty(Q, *b0.shape[:-1], dtype=cdt)


@torch.library.custom_op("hybrid_attention::attn_res_partial_bwd", mutates_args=())
def _partial_bwd_op(
    dout: list[Tensor],
    dlse: Tensor,
    blocks: list[Tensor],
    queries: Tensor,
    key_weights: Tensor,
    lse: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """(d blocks [N, ..., D] in the blocks' dtype, dL/du [Q, D] with u = queries * key_weights)."""
    return _partial_backward_kernels(dout, dlse, blocks, queries, key_weights, lse, eps)


@_partial_bwd_op.register_fake
def _(dout, dlse, blocks, queries, key_weights, lse, eps):
    b0 = blocks[0]
    return b0.new_empty(len(blocks), *b0.shape), lse.new_empty(queries.shape)


_partial_fwd_call = eager_or_traced(_partial_fwd_op, _partial_forward)
_partial_bwd_call = eager_or_traced(_partial_bwd_op, _partial_backward_kernels)


class _Partial(torch.autograd.Function):
    """Phase 1 for Q queries: (out_0 .. out_{Q-1}, lse) from the N blocks."""

    @staticmethod
    def forward(ctx, queries, key_weights, eps, *blocks):
        out, lse = _partial_fwd_call(list(blocks), queries, key_weights, eps)
        ctx.save_for_backward(*blocks, queries, key_weights, lse)  # the backward never reads out
        ctx.eps = eps
        return *out, lse

    @staticmethod
    def backward(ctx, *grads):
        *dout, dlse = grads
        *blocks, queries, key_weights, lse = ctx.saved_tensors
        dblk, du = _partial_bwd_call(dout, dlse, blocks, queries, key_weights, lse, ctx.eps)
        dq, dkw = (du * key_weights).to(queries.dtype), (du * queries).to(key_weights.dtype)
        return dq, dkw, None, *dblk.unbind(0)


# ------------------------------------------------------------------------------------------- Block AttnRes, phase 2
def _merge_forward(out, lse, partial, query, key_weight, norm_weight, eps, norm_eps, dtype):
    shape, D = out.shape, out.shape[-1]
    flat_partial = None if partial is None else partial.contiguous().view(-1, D)
    x, rho = merge_norm_fwd(
        out.contiguous().view(-1, D),
        lse.contiguous().view(-1),
        flat_partial,
        query,
        key_weight,
        norm_weight,
        eps,
        norm_eps,
        dtype,
    )
    return x.view(shape), rho.view(shape[:-1])


def _merge_backward_kernels(dx, out, lse, partial, query, key_weight, norm_weight, rho, eps):
    shape, D = out.shape, out.shape[-1]
    flat_partial = None if partial is None else partial.contiguous().view(-1, D)
    dout, dlse, dpartial, du, dnw = merge_norm_bwd(
        dx.contiguous().view(-1, D),
        out.contiguous().view(-1, D),
        lse.contiguous().view(-1),
        flat_partial,
        query,
        key_weight,
        norm_weight,
        rho.view(-1),
        eps,
    )
    if partial is None:
        return dout.view(shape), _distinct_empty(lse), _distinct_empty(out), _distinct_empty(out), dnw
    return dout.view(shape), dlse.view(shape[:-1]), dpartial.view(shape), du, dnw


@torch.library.custom_op("hybrid_attention::attn_res_merge_norm_fwd", mutates_args=())
def _merge_fwd_op(
    out: Tensor,
    lse: Tensor,
    partial: Tensor | None,
    query: Tensor,
    key_weight: Tensor,
    norm_weight: Tensor,
    eps: float,
    norm_eps: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """(x [..., D] in `dtype`, rho [...] in the compute dtype)."""
    return _merge_forward(out, lse, partial, query, key_weight, norm_weight, eps, norm_eps, dtype)


@_merge_fwd_op.register_fake
def _(out, lse, partial, query, key_weight, norm_weight, eps, norm_eps, dtype):
    return out.new_empty(out.shape, dtype=dtype), lse.new_empty(lse.shape)


@torch.library.custom_op("hybrid_attention::attn_res_merge_norm_bwd", mutates_args=())
def _merge_bwd_op(
    dx: Tensor,
    out: Tensor,
    lse: Tensor,
    partial: Tensor | None,
    query: Tensor,
    key_weight: Tensor,
    norm_weight: Tensor,
    rho: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d out, d lse, d partial, dL/du [D], d norm_weight [D]); without `partial` the 2nd to 4th are empty."""
    return _merge_backward_kernels(dx, out, lse, partial, query, key_weight, norm_weight, rho, eps)


@_merge_bwd_op.register_fake
def _(dx, out, lse, partial, query, key_weight, norm_weight, rho, eps):
    D = out.shape[-1]
    if partial is None:
        return torch.empty_like(out), lse.new_empty(0), out.new_empty(0), out.new_empty(0), out.new_empty(D)
    return torch.empty_like(out), torch.empty_like(lse), torch.empty_like(partial), out.new_empty(D), out.new_empty(D)


_merge_fwd_call = eager_or_traced(_merge_fwd_op, _merge_forward)
_merge_bwd_call = eager_or_traced(_merge_bwd_op, _merge_backward_kernels)


class _MergeNorm(torch.autograd.Function):
    """Phase 2 + RMSNorm: x from (out, lse) and the block's partial sum (None: h = out)."""

    @staticmethod
    def forward(ctx, out, lse, partial, query, key_weight, norm_weight, eps, norm_eps, dtype):
        x, rho = _merge_fwd_call(out, lse, partial, query, key_weight, norm_weight, eps, norm_eps, dtype)
        ctx.save_for_backward(out, lse, partial, query, key_weight, norm_weight, rho)
        ctx.eps = eps
        return x

    @staticmethod
    def backward(ctx, dx):
        out, lse, partial, query, key_weight, norm_weight, rho = ctx.saved_tensors
        dout, dlse, dpartial, du, dnw = _merge_bwd_call(
            dx, out, lse, partial, query, key_weight, norm_weight, rho, ctx.eps
        )
        dnw = dnw.to(norm_weight.dtype)
        if partial is None:  # h = out: lse, the query and the key-norm weight play no part
            return dout, None, None, None, None, dnw, None, None, None
        dq, dkw = (du * key_weight).to(query.dtype), (du * query).to(key_weight.dtype)
        return dout, dlse, dpartial, dq, dkw, dnw, None, None, None


# ----------------------------------------------------------------------------------------------- public functions
def attn_res_partial_train(
    blocks: Sequence[Tensor], queries: Tensor, key_weights: Tensor, eps: float = 1e-6
) -> tuple[list[Tensor], Tensor]:
    """Block AttnRes phase 1 for the Q sublayers of a block at once, differentiable.

    Args:
        blocks: N x [B, T, D], the completed block sums (b_0 is the embedding), one dtype and shape.
        queries, key_weights: [Q, D], the pseudo-queries and key-norm weights of the Q sublayers.

    Returns:
        out: Q x [B, T, D] in the blocks' dtype and lse [Q, B, T] in float32 (float64 for float64 blocks):
        (out[q], lse[q]) equals `naive_attn_res_partial(blocks, queries[q], key_weights[q], eps)`, with out[q] rounded
        to the blocks' dtype (as the sublayer outputs are; the reference keeps it in the compute dtype).
    """
    name = "attn_res_partial_train"
    blocks = check_sources(name, blocks)
    D = blocks[0].shape[-1]
    for label, t in (("queries", queries), ("key_weights", key_weights)):
        if t.dim() != 2 or t.shape[1] != D or t.shape[0] != queries.shape[0] or t.shape[0] == 0:
            raise ValueError(f"{name}: {label} must have shape [Q, {D}] with Q >= 1 (the same Q), got {tuple(t.shape)}")
    *out, lse = _Partial.apply(queries.contiguous(), key_weights.contiguous(), float(eps), *blocks)
    return out, lse


def attn_res_merge_norm_train(
    out: Tensor,
    lse: Tensor,
    partial: Tensor | None,
    query: Tensor,
    key_weight: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Block AttnRes phase 2 fused with the sublayer's RMSNorm, differentiable.

    Args:
        out, lse: [B, T, D] and [B, T], this sublayer's row of phase 1: out in any float dtype (the blocks' from
            `attn_res_partial_train`, float32 from the reference), lse in out's compute dtype.
        partial: [B, T, D], the partial sum of the sublayer's block, or None for the sublayer that opens the block
            (then h = out).
        query, key_weight: [D], as in phase 1; norm_weight: [D], the RMSNorm's weight, norm_eps its epsilon.
        dtype: dtype of the result (and of h before the norm); defaults to partial's (required without it).

    Returns:
        [B, T, D]: `rms_norm(naive_attn_res_merge(out, lse, partial, query, key_weight, eps), norm_weight, norm_eps)`.
    """
    name = "attn_res_merge_norm_train"
    D = out.shape[-1]
    check_vectors(name, D, query=query, key_weight=key_weight, norm_weight=norm_weight)
    if not out.is_floating_point() or lse.dtype != compute_dtype(out) or lse.shape != out.shape[:-1]:
        raise ValueError(
            f"{name}: out and lse must be phase-1 results (lse [...] in out's compute dtype for out [..., D]), got "
            f"out {out.dtype} {tuple(out.shape)}, lse {lse.dtype} {tuple(lse.shape)}"
        )
    if partial is not None:
        check_sources(name, [partial])
        if partial.shape != out.shape or compute_dtype(partial) != lse.dtype:
            raise ValueError(
                f"{name}: partial must be {tuple(out.shape)} with compute dtype {lse.dtype}, got "
                f"{partial.dtype} {tuple(partial.shape)}"
            )
    elif dtype is None:
        raise ValueError(f"{name}: without a partial sum, pass dtype (the dtype of h and of the result)")
    else:
        check_sources(name, [out])
    dtype = dtype or partial.dtype
    return _MergeNorm.apply(out, lse, partial, query, key_weight, norm_weight, float(eps), float(norm_eps), dtype)
