"""A Full AttnRes residual stream for training: each step RMSNorm(AttnRes(sources)) in fused kernels, each source's
gradient assembled once, complete, through tables shared by the stream's backwards (docs/kernels.md, "Training, a
Full AttnRes stream").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from hybrid_attention.ops.attnres.rows import check_sources, residual_scale
from hybrid_attention.ops.attnres.triton_mix_norm import full_fwd
from hybrid_attention.ops.attnres.triton_stream_bwd import param_table_rows, stream_bwd_, stream_param_grads
from hybrid_attention.ops.numerics import compute_dtype
from hybrid_attention.ops.triton_support import eager_or_traced


class Carrier(NamedTuple):
    """What a step hands to the next one (to it alone): the stream's constants and the placeholders whose gradients
    are the backward tables."""

    step: int  # index of the step that returned it
    sources: int  # how many sources that step read
    queries: Tensor  # [K, D]
    key_weights: Tensor  # [K, D]
    norm_weights: Tensor  # [K, D]
    eps: float  # the key norms' epsilon, one for the stream (the backward recomputes r_i once per source)
    tables: tuple[Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("hybrid_attention::attn_res_stream_fwd", mutates_args=())
def _fwd_op(
    sources: list[Tensor], query: Tensor, key_weight: Tensor, norm_weight: Tensor, eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(x, h [..., D] in the sources' dtype, h's int8 rounding residual [..., D] (empty unless the sources are
    half), stats [2, ...] in the compute dtype: lse, then rho, logits [S, ...] in the compute dtype)."""
    return _stream_fwd(sources, query, key_weight, norm_weight, eps, norm_eps)


def _stream_fwd(sources, query, key_weight, norm_weight, eps, norm_eps):
    return full_fwd(sources, query, key_weight, norm_weight, eps, norm_eps, save_h=True, save_logits=True)


@_fwd_op.register_fake
def _(sources, query, key_weight, norm_weight, eps, norm_eps):
    s0, cdt = sources[0], compute_dtype(sources[0])
    rows = s0.shape[:-1]
    return (
        torch.empty_like(s0),
        torch.empty_like(s0),
        s0.new_empty(s0.shape if residual_scale(s0.dtype) else (0,), dtype=torch.int8),
        s0.new_empty(2, *rows, dtype=cdt),
        s0.new_empty(len(sources), *rows, dtype=cdt),
    )


@torch.library.custom_op("hybrid_attention::attn_res_stream_bwd", mutates_args=("dh_early", "dh_late", "rows", "cols"))
def _bwd_op(
    dx: Tensor | None,
    h: Tensor,
    h_res: Tensor,
    stats: Tensor,
    logits: Tensor,
    queries: Tensor,
    key_weights: Tensor,
    norm_weight: Tensor,
    sources: list[Tensor],
    dh_early: Tensor,
    dh_late: Tensor,
    rows: Tensor,
    cols: Tensor,
    step: int,
    eps: float,
) -> Tensor:
    """Writes step `step`'s entries of the tables and adds to the dL/du partial sums; -> the gradients of `sources`
    [n, ..., D] in their dtype."""
    return _stream_bwd(
        dx,
        h,
        h_res,
        stats,
        logits,
        queries,
        key_weights,
        norm_weight,
        sources,
        dh_early,
        dh_late,
        rows,
        cols,
        step,
        eps,
    )


def _stream_bwd(dx, *args):
    return stream_bwd_(None if dx is None else dx.contiguous(), *args)


@_bwd_op.register_fake
def _(
    dx, h, h_res, stats, logits, queries, key_weights, norm_weight, sources, dh_early, dh_late, rows, cols, step, eps
):
    s0 = sources[0]
    return s0.new_empty(len(sources), *s0.shape)


@torch.library.custom_op("hybrid_attention::attn_res_stream_param_grads", mutates_args=())
def _param_grads_op(cols: Tensor, splits: int) -> tuple[Tensor, Tensor]:
    """(dL/du, dL/d norm_weight) [K, D] of every step of a stream, from its cols table with `splits` partial sums of
    dL/du."""
    return stream_param_grads(cols, splits)


@_param_grads_op.register_fake
def _(cols, splits):
    return cols.new_empty(cols.shape[1:]), cols.new_empty(cols.shape[1:])


_fwd = eager_or_traced(_fwd_op, _stream_fwd)
_bwd = eager_or_traced(_bwd_op, _stream_bwd)
_param_grads = eager_or_traced(_param_grads_op, stream_param_grads)


def early_steps(K: int) -> int:
    """How many of a stream's K steps keep their dh in the early table: all but the last quarter."""
    return K - -(-K // 4)


def _dh_table(h: Tensor, steps: int, live: int) -> Tensor:
    """A dh table of `steps` entries like h, allocated by the first backward of its steps to run: the entries from
    `live` on belong to steps that never run their backward, so they are zero (their terms are then exactly zero)."""
    dh = torch.empty(steps, *h.shape, device=h.device, dtype=h.dtype)
    dh[max(live, 0) :].zero_()
    return dh


def _new_tables(
    h: Tensor, stats: Tensor, K: int, k_split: int, step: int, S: int, cols_rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The late dh table (steps k_split ..), rows and cols of a stream over S sources (cols with `cols_rows` rows),
    for the first backward to run (step `step`): the steps after it never run theirs, so their entries are zero (dh =
    0, c = 0 and u = 0, lse = 0, z = 0 keep p finite: their terms are exactly zero; their partial sums stay zero)."""
    dh_late = _dh_table(h, K - k_split, step + 1 - k_split)
    rows = torch.zeros(K, 2 + S, *h.shape[:-1], device=h.device, dtype=stats.dtype)
    cols = torch.zeros(cols_rows, K, h.shape[-1], device=h.device, dtype=stats.dtype)
    return dh_late, rows, cols


class _StreamStep(torch.autograd.Function):
    """Step `step` of a stream: x = RMSNorm(AttnRes(sources)) with the step's row of queries, key_weights and
    norm_weights, and the four table placeholders. `dh_early_c, dh_late_c, rows_c, cols_c`: the previous step's
    placeholders (None at the start)."""

    @staticmethod
    def forward(
        ctx, dh_early_c, dh_late_c, rows_c, cols_c, queries, key_weights, norm_weights, eps, norm_eps, step, *sources
    ):
        norm_weight = norm_weights[step]
        x, h, h_res, stats, logits = _fwd(list(sources), queries[step], key_weights[step], norm_weight, eps, norm_eps)
        assembled = sources if step == 0 else sources[-1:]
        ctx.save_for_backward(h, h_res, stats, logits, queries, key_weights, norm_weights, *assembled)
        ctx.eps, ctx.step, ctx.n = eps, step, len(sources)
        ctx.set_materialize_grads(False)  # no gradient for the placeholders: this is the first backward to run
        K, D = queries.shape
        k_split = early_steps(K)
        ctx.stream_sources = len(sources) + K - 1 - step  # each later step reads one more
        ctx.splits, programs = param_table_rows(x.numel() // D if D else 0, x.device)
        ctx.cols_rows = 1 + ctx.splits + programs
        placeholders = (
            x.new_empty(()).expand(k_split, *x.shape),
            x.new_empty(()).expand(K - k_split, *x.shape),
            stats.new_empty(()).expand(K, 2 + ctx.stream_sources, *x.shape[:-1]),
            stats.new_empty(()).expand(ctx.cols_rows, K, D),
        )
        return x, *placeholders

    @staticmethod
    def backward(ctx, dx, dh_early, dh_late, rows, cols):
        h, h_res, stats, logits, queries, key_weights, norm_weights, *assembled = ctx.saved_tensors
        step, n, K = ctx.step, ctx.n, queries.shape[0]
        k_split = early_steps(K)
        if rows is None:
            if dx is None:  # neither this step nor a later one reaches the loss
                return (None,) * (10 + n)
            dh_late, rows, cols = _new_tables(h, stats, K, k_split, step, ctx.stream_sources, ctx.cols_rows)
        # The early table is allocated only when the backward reaches its steps: by then the later layers' saved
        # tensors are freed, so the whole [K, ..., D] of dh never adds to the memory peak at the backward's start.
        if step < k_split and dh_early is None:
            dh_early = _dh_table(h, k_split, step + 1)
        early = h.new_empty(0) if dh_early is None else dh_early  # not read while step >= k_split
        args = (dx, h, h_res, stats, logits, queries, key_weights, norm_weights[step], assembled)
        dv = _bwd(*args, early, dh_late, rows, cols, step, ctx.eps)
        if step > 0:
            return (dh_early, dh_late, rows, cols, *([None] * 6), *([None] * (n - 1)), dv[0])
        # Complete: every source is assembled and every step has added its partial sums.
        du, dnw = _param_grads(cols, ctx.splits)
        dq, dkw = (du * key_weights.to(du.dtype)).to(queries.dtype), (du * queries.to(du.dtype)).to(key_weights.dtype)
        return (None, None, None, None, dq, dkw, dnw.to(norm_weights.dtype), None, None, None, *dv.unbind(0))


def attn_res_norm_stream_start(
    sources: Sequence[Tensor],
    queries: Tensor,
    key_weights: Tensor,
    norm_weights: Tensor,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
) -> tuple[Tensor, Carrier]:
    """The first step of a Full AttnRes stream of K steps: RMSNorm(AttnRes(sources)) with queries[0], key_weights[0]
    and norm_weights[0].

    Args:
        sources: S x [B, T, D] (any [..., D]), one dtype and shape, contiguous, each its own tensor.
        queries, key_weights, norm_weights: [K, D], the pseudo-queries, key-norm weights and RMSNorm weights of all K
            steps of the stream, in order (stacked once; each parameter gets its gradient through the stack). eps:
            the key norms' epsilon. Each step's RMSNorm is applied to h rounded to the sources' dtype.
        norm_eps: this step's RMSNorm epsilon.

    Returns:
        x [B, T, D] in the sources' dtype, equal to `rms_norm(naive_attn_res(sources, queries[0], key_weights[0], eps),
        norm_weights[0], norm_eps)`, and the carrier for step 1 (`attn_res_norm_step`).
    """
    name = "attn_res_norm_stream_start"
    check_sources(name, sources)
    for i, s in enumerate(sources):
        if not s.is_contiguous():
            raise ValueError(f"{name}: source {i} must be contiguous (its strides are {s.stride()})")
    D = sources[0].shape[-1]
    stacked = (("queries", queries), ("key_weights", key_weights), ("norm_weights", norm_weights))
    for label, t in stacked:
        if t.dim() != 2 or t.shape[1] != D or t.shape[0] != queries.shape[0] or t.shape[0] == 0:
            raise ValueError(f"{name}: {label} must have shape [K, {D}] with K >= 1 (the same K), got {tuple(t.shape)}")
    queries, key_weights, norm_weights = (t.contiguous() for _, t in stacked)
    eps = float(eps)
    x, *tables = _StreamStep.apply(
        None, None, None, None, queries, key_weights, norm_weights, eps, float(norm_eps), 0, *sources
    )
    return x, Carrier(0, len(sources), queries, key_weights, norm_weights, eps, tuple(tables))


def attn_res_norm_step(sources: Sequence[Tensor], carrier: Carrier, norm_eps: float = 1e-6) -> tuple[Tensor, Carrier]:
    """The next step k of a Full AttnRes stream: RMSNorm(AttnRes(sources)) with the stream's queries[k],
    key_weights[k] and norm_weights[k].

    Args:
        sources: the previous step's sources (the same tensors, in the same order) and one more, contiguous, like
            source 0.
        carrier: the previous step's (to be used by this step alone).
        norm_eps: this step's RMSNorm epsilon.

    Returns:
        x [B, T, D] and the carrier for the next step (drop the last step's).
    """
    name = "attn_res_norm_step"
    step, K = carrier.step + 1, carrier.queries.shape[0]
    if step >= K:
        raise ValueError(f"{name}: the stream was started for {K} steps (queries [{K}, D]); this would be step {step}")
    if len(sources) != carrier.sources + 1:
        raise ValueError(
            f"{name}: expected the previous step's {carrier.sources} sources and one more, got {len(sources)}"
        )
    newest, s0 = sources[-1], sources[0]
    if newest.shape != s0.shape or newest.dtype != s0.dtype or newest.device != s0.device:
        raise ValueError(
            f"{name}: the newest source must be {s0.dtype} {tuple(s0.shape)} on {s0.device} like source 0, got "
            f"{newest.dtype} {tuple(newest.shape)} on {newest.device}"
        )
    if not newest.is_contiguous():
        raise ValueError(f"{name}: the newest source must be contiguous (its strides are {newest.stride()})")
    x, *tables = _StreamStep.apply(
        *carrier.tables,
        carrier.queries,
        carrier.key_weights,
        carrier.norm_weights,
        carrier.eps,
        float(norm_eps),
        step,
        *sources,
    )
    return x, carrier._replace(step=step, sources=len(sources), tables=tuple(tables))
