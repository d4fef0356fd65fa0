"""Full AttnRes fused with the RMSNorm of the sublayer that reads it, differentiable, for training.

- `attn_res_norm_train(sources, ...)`: one RMSNorm(AttnRes(sources)); every source gets its gradient.
- `attn_res_norm_step(sources, carrier, ...)`: one step of a Full AttnRes residual stream, where the steps share
  one gradient accumulator.

Step l of a stream reads the sources v_0 .. v_{l-1} (the embedding and every earlier sublayer output) and its
backward has a gradient for each of them. Returned to autograd one tensor per source, these would be depth^2 / 2
[..., D] tensors for autograd to sum. Instead the steps are chained by a carrier: a step returns, besides x, a
carrier [l, ..., D] (a zero-stride placeholder that holds no memory) which the next step takes as an input. The
carrier's gradient is the accumulator acc: the last step's backward (the first to run) allocates acc [S, ..., D] and
writes its sources' gradients into it; every earlier step adds its own into acc[:l] in place (in the kernel, in a
fixed order), hands the now complete acc[l-1] to its newest source (no earlier step reads that source) and acc[:l-1]
to the step before, as the gradient of that step's carrier. So each source's gradient is one slice of one buffer,
and autograd sums nothing.

The kernels (`triton_full.py`) are custom ops with fake implementations, called from an autograd.Function, and the
backward op declares its in-place update of acc: `torch.compile(fullgraph=True)` traces a training step through
them and keeps one accumulator. Eager calls the ops' bodies directly (no dispatcher round trip per call). The
readable reference is `rms_norm(naive.attn_res(sources, ...))`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybrid_attention.ops.attnres.rows import check_sources, check_vectors
from hybrid_attention.ops.attnres.triton_full import full_bwd_, full_fwd
from hybrid_attention.ops.numerics import compute_dtype


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


@torch.library.custom_op("hybrid_attention::attn_res_norm_bwd_accumulate", mutates_args=("acc",))
def _bwd_op(
    dout: Tensor, sources: list[Tensor], acc: Tensor, query: Tensor, key_weight: Tensor, norm_weight: Tensor,
    stats: Tensor, eps: float, accumulate: bool,
) -> Tensor:  # fmt: skip
    """Adds (accumulate) or writes every source's gradient into acc [S, ..., D]; returns the gradients of query,
    key_weight and norm_weight as one [3, D] tensor in the query's dtype."""
    return full_bwd_(dout.contiguous(), sources, acc, query, key_weight, norm_weight, stats, eps, accumulate)


@_bwd_op.register_fake
def _(dout, sources, acc, query, key_weight, norm_weight, stats, eps, accumulate):
    return query.new_empty(3, query.shape[0])


def _fwd(*args):
    # torch.compile traces the custom op; eager calls its body directly (the same code, without the dispatcher).
    return _fwd_op._opoverload(*args) if torch.compiler.is_compiling() else full_fwd(*args)


def _bwd(dout, *args):
    if torch.compiler.is_compiling():
        return _bwd_op._opoverload(dout, *args)
    return full_bwd_(dout.contiguous(), *args)


class _AttnResNorm(torch.autograd.Function):
    """x = RMSNorm(AttnRes(sources)); with `chain`, also a carrier [S, ..., D] whose gradient is the accumulator.
    `carrier` (or None): the previous step's, when the sources are its sources and one more."""

    @staticmethod
    def forward(ctx, carrier, query, key_weight, norm_weight, eps, norm_eps, chain, *sources):
        x, stats = _fwd(list(sources), query, key_weight, norm_weight, eps, norm_eps)
        ctx.save_for_backward(query, key_weight, norm_weight, stats, *sources)
        ctx.eps, ctx.chained = eps, carrier is not None
        ctx.set_materialize_grads(False)  # no gradient for the carrier: this step starts the accumulator
        if not chain:
            return x
        return x, x.new_empty(()).expand(len(sources), *x.shape)

    @staticmethod
    def backward(ctx, dx, dcarrier=None):
        query, key_weight, norm_weight, stats, *sources = ctx.saved_tensors
        S = len(sources)
        if dx is None and dcarrier is None:
            return (None,) * (7 + S)
        dq = dkw = dnw = None
        if dx is None:  # x unused, the carrier used: this step adds nothing, the accumulator passes on
            acc = dcarrier
        else:
            accumulate = dcarrier is not None
            if accumulate:
                acc = dcarrier.contiguous()
            else:
                s0 = sources[0]
                acc = torch.empty(S, *s0.shape, device=s0.device, dtype=s0.dtype)
            grads = _bwd(dx, sources, acc, query, key_weight, norm_weight, stats, ctx.eps, accumulate)
            params = (query, key_weight, norm_weight)
            dq, dkw, dnw = (g.to(p.dtype) for g, p in zip(grads.unbind(0), params, strict=True))
        if ctx.chained:  # the older sources' gradients are not complete yet: the steps before add theirs
            return (acc[: S - 1], dq, dkw, dnw, None, None, None, *([None] * (S - 1)), acc[S - 1])
        return (None, dq, dkw, dnw, None, None, None, *acc.unbind(0))


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
        [B, T, D] in the sources' dtype, equal to `rms_norm(attn_res(sources, query, key_weight, eps), norm_weight,
        norm_eps)` with the math in float32 (float64 for float64 sources). The sources' gradients are slices of one
        [S, B, T, D] buffer.
    """
    name = "attn_res_norm_train"
    sources = check_sources(name, sources)
    check_vectors(name, sources[0].shape[-1], query=query, key_weight=key_weight, norm_weight=norm_weight)
    return _AttnResNorm.apply(None, query, key_weight, norm_weight, float(eps), float(norm_eps), False, *sources)


def attn_res_norm_step(
    sources: Sequence[Tensor],
    carrier: Tensor | None,
    query: Tensor,
    key_weight: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
    *,
    last: bool = False,
) -> tuple[Tensor, Tensor] | Tensor:
    """One step of a Full AttnRes stream: `attn_res_norm_train(sources, ...)`, with the sources' gradients summed in
    one accumulator shared by the stream's steps (see the module docstring).

    Args:
        sources: S x [B, T, D], one dtype and shape, contiguous: the previous step's sources (the same tensors, in
            the same order) and one more, or any sources for the step that starts the stream.
        carrier: the previous step's carrier [S - 1, B, T, D], or None for the step that starts the stream (which
            then gives every source its gradient).
        query, key_weight, norm_weight, eps, norm_eps: as in `attn_res_norm_train`.
        last: the stream's last step (no later step takes a carrier from it).

    Returns:
        x [B, T, D], and unless `last` the carrier [S, B, T, D] for the next step (to be used by it alone).
    """
    name = "attn_res_norm_step"
    if carrier is None:
        check_sources(name, sources)
        for i, s in enumerate(sources):
            if not s.is_contiguous():
                raise ValueError(f"{name}: source {i} must be contiguous (its strides are {s.stride()})")
    else:
        if carrier.shape[0] != len(sources) - 1 or carrier.shape[1:] != sources[0].shape:
            raise ValueError(
                f"{name}: the carrier must come from the step before, over {len(sources) - 1} sources "
                f"[{len(sources) - 1}, {', '.join(map(str, sources[0].shape))}]; got {tuple(carrier.shape)}"
            )
        newest, s0 = sources[-1], sources[0]
        if newest.shape != s0.shape or newest.dtype != s0.dtype or newest.device != s0.device:
            raise ValueError(
                f"{name}: the newest source must be {s0.dtype} {tuple(s0.shape)} on {s0.device} like source 0, got "
                f"{newest.dtype} {tuple(newest.shape)} on {newest.device}"
            )
        if not newest.is_contiguous():
            raise ValueError(f"{name}: the newest source must be contiguous (its strides are {newest.stride()})")
    check_vectors(name, sources[0].shape[-1], query=query, key_weight=key_weight, norm_weight=norm_weight)
    return _AttnResNorm.apply(carrier, query, key_weight, norm_weight, float(eps), float(norm_eps), not last, *sources)
