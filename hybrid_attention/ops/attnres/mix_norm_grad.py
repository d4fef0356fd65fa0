"""One Full AttnRes fused with the RMSNorm of the sublayer that reads it, differentiable, for training:
`attn_res_norm_train(sources, ...)`, every source getting its gradient (docs/kernels.md, "Attention Residuals kernels").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybrid_attention.ops.attnres.rows import check_sources, check_vectors
from hybrid_attention.ops.attnres.triton_mix_norm import full_bwd, full_fwd
from hybrid_attention.ops.numerics import compute_dtype
from hybrid_attention.ops.triton_support import eager_or_traced


@torch.library.custom_op("hybrid_attention::attn_res_norm_fwd", mutates_args=())
def _fwd_op(
    sources: list[Tensor], query: Tensor, key_weight: Tensor, norm_weight: Tensor, eps: float, norm_eps: float
) -> tuple[Tensor, Tensor]:
    """(x [..., D] in the sources' dtype, stats [2, ...] in the compute dtype: lse, then rho)."""
    return full_fwd(sources, query, key_weight, norm_weight, eps, norm_eps)


@_fwd_op.register_fake
def _(sources, query, key_weight, norm_weight, eps, norm_eps):
    s0 = sources[0]
    return torch.empty_like(s0), s0.new_empty(2, *s0.shape[:-1], dtype=compute_dtype(s0))


def _backward_kernels(dout, sources, query, key_weight, norm_weight, stats, eps):
    return full_bwd(dout.contiguous(), sources, query, key_weight, norm_weight, stats, eps)


@torch.library.custom_op("hybrid_attention::attn_res_norm_bwd", mutates_args=())
def _bwd_op(
    dout: Tensor,
    sources: list[Tensor],
    query: Tensor,
    key_weight: Tensor,
    norm_weight: Tensor,
    stats: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """(the sources' gradients [S, ..., D] in their dtype, the gradients of query, key_weight and norm_weight as one
    [3, D] tensor in the query's dtype)."""
    return _backward_kernels(dout, sources, query, key_weight, norm_weight, stats, eps)


@_bwd_op.register_fake
def _(dout, sources, query, key_weight, norm_weight, stats, eps):
    s0 = sources[0]
    return s0.new_empty(len(sources), *s0.shape), query.new_empty(3, query.shape[0])


_fwd = eager_or_traced(_fwd_op, full_fwd)
_bwd = eager_or_traced(_bwd_op, _backward_kernels)


class _AttnResNorm(torch.autograd.Function):
    """x = RMSNorm(AttnRes(sources)); the sources' gradients are slices of one [S, ..., D] buffer."""

    @staticmethod
    def forward(ctx, query, key_weight, norm_weight, eps, norm_eps, *sources):
        x, stats = _fwd(list(sources), query, key_weight, norm_weight, eps, norm_eps)
        ctx.save_for_backward(query, key_weight, norm_weight, stats, *sources)
        ctx.eps = eps
        return x

    @staticmethod
    def backward(ctx, dx):
        query, key_weight, norm_weight, stats, *sources = ctx.saved_tensors
        dsrc, grads = _bwd(dx, sources, query, key_weight, norm_weight, stats, ctx.eps)
        params = (query, key_weight, norm_weight)
        dq, dkw, dnw = (g.to(p.dtype) for g, p in zip(grads.unbind(0), params, strict=True))
        return (dq, dkw, dnw, None, None, *dsrc.unbind(0))


def attn_res_norm_train(
    sources: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
) -> Tensor:
    """RMSNorm(AttnRes(sources)) in one Triton kernel each way, differentiable in every input.

    Args:
        sources: S x [B, T, D] (any [..., D]), one dtype and shape, each its own tensor (never stacked).
        query, key_weight: [D], the AttnRes pseudo-query and key-norm weight; eps is the key norm's epsilon.
        norm_weight: [D], the weight of the RMSNorm applied to the mixture h (rounded to the sources' dtype first);
            norm_eps is its epsilon.

    Returns:
        [B, T, D] in the sources' dtype, equal to
        `rms_norm(naive_attn_res(sources, query, key_weight, eps), norm_weight, norm_eps)` with the math in float32
        (float64 for float64 sources). The sources' gradients are slices of one [S, B, T, D] buffer.
    """
    name = "attn_res_norm_train"
    sources = check_sources(name, sources)
    check_vectors(name, sources[0].shape[-1], query=query, key_weight=key_weight, norm_weight=norm_weight)
    return _AttnResNorm.apply(query, key_weight, norm_weight, float(eps), float(norm_eps), *sources)
