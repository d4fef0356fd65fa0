"""The decoder's residual stream: how each sublayer's input is built from the embedding and the earlier outputs
(standard residual, Full or Block Attention Residuals), on the readable path or on the fused ops (docs/training.md)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from hybrid_attention.choices import RESIDUALS
from hybrid_attention.layers.attnres import AttnRes
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.ops.attnres.block_stream import attn_res_merge_norm_train, attn_res_partial_train
from hybrid_attention.ops.attnres.full_stream import attn_res_norm_step, attn_res_norm_stream_start
from hybrid_attention.ops.attnres.mix_norm import attn_res_norm
from hybrid_attention.ops.attnres.rows import fused_train_supported
from hybrid_attention.ops.backends import use_triton

# One step of the stream: (the AttnRes that builds the input, the RMSNorm that reads it, the sublayer g taking the
# normalised input to its output). The first step reads the embedding alone, where an AttnRes is the identity, so it
# has none; the final step's g is None and its norm is the output norm.
Step = tuple[AttnRes | None, RMSNorm, Callable[[torch.Tensor], torch.Tensor] | None]


def residual_stream(
    residual: str, embedding: torch.Tensor, steps: Sequence[Step], *, block_size: int = 1, backend: str = "auto"
) -> torch.Tensor:
    """Run every sublayer of a decoder on its input and return FinalNorm(h_final) [B, T, D].

    Args:
        residual: "standard", "attnres" (Full AttnRes) or "block_attnres" (blocks of `block_size` sublayers).
        embedding: [B, T, D], the stream's first source.
        steps: one (attn_res, norm, g) per sublayer in order, then (final_attn_res, final_norm, None); the attn_res
            of the first step, and every one of a standard stream, is None.
        backend: "auto" (the fused Triton ops where `ops.backends` picks them), "triton" or "torch" (the readable
            path).
    """
    _check(residual, steps)
    if residual == "standard":
        return _standard(embedding, steps)
    if residual == "attnres" and not torch.is_grad_enabled():
        return _full_inference(embedding, steps, backend)
    if _fused(embedding, backend):
        if residual == "attnres":
            return full_attn_res_stream(embedding, steps)
        return block_attn_res_stream(embedding, steps, block_size)
    return _block_readable(embedding, steps, 1 if residual == "attnres" else block_size)


def _check(residual: str, steps: Sequence[Step]) -> None:
    if residual not in RESIDUALS:
        raise ValueError(f"residual_stream: residual={residual!r}; expected one of {RESIDUALS}")
    if not steps or steps[-1][2] is not None or any(g is None for _, _, g in steps[:-1]):
        raise ValueError("residual_stream: expected steps ending with the final norm, the only one with g None")
    if steps[0][0] is not None:
        raise ValueError("residual_stream: the first step reads the embedding alone and takes no AttnRes")
    if residual != "standard" and any(res is None for res, _, _ in steps[1:]):
        raise ValueError(f"residual_stream: {residual} needs an AttnRes on every step after the first")


def _fused(embedding: torch.Tensor, backend: str) -> bool:
    """Whether AttnRes runs through the fused differentiable ops (ops/attnres/full_stream.py, block_stream.py)."""
    if backend == "triton" and not fused_train_supported(embedding):
        raise ValueError(
            "attnres_backend='triton' needs triton and CUDA tensors (or CPU with TRITON_INTERPRET=1) of a supported "
            f"dtype; got {embedding.dtype} on {embedding.device}; use 'auto' or 'torch'"
        )
    return backend == "triton" or (backend == "auto" and use_triton(embedding) and fused_train_supported(embedding))


def _standard(h: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    for _, norm, g in steps[:-1]:
        h = h + g(norm(h))
    return steps[-1][1](h)


def _block_readable(embedding: torch.Tensor, steps: Sequence[Step], block_size: int) -> torch.Tensor:
    """The readable path: sublayer i attends over the completed block sums b_0 = embedding, b_1, ... and, unless it
    opens a block, the partial sum of its own block (docs/math.md). Block size 1 is Full AttnRes."""
    blocks, partial = [embedding], None
    for i, (res, norm, g) in enumerate(steps):
        if i % block_size == 0 and partial is not None:
            blocks.append(partial)
            partial = None
        sources = blocks if partial is None else [*blocks, partial]
        x = norm(sources[0] if res is None else res(sources))
        if g is None:
            return x
        y = g(x)
        partial = y if partial is None else partial + y
    raise AssertionError("unreachable: the last step has g None")


def _full_inference(embedding: torch.Tensor, steps: Sequence[Step], backend: str) -> torch.Tensor:
    """Full AttnRes without autograd (inference, decoding): the sources live in one preallocated [S, B, T, D] buffer,
    each written once by the AttnRes that first reads it, and every AttnRes is fused with the RMSNorm that reads it
    (`attn_res_norm`: one Triton kernel on CUDA)."""
    (_, norm, g), rest = steps[0], steps[1:]
    x = norm(embedding)
    if g is None:
        return x
    sources = embedding.new_empty(len(steps), *embedding.shape)  # (S, B, T, D)
    sources[0] = embedding
    latest = g(x).to(sources.dtype)  # a no-op unless autocast made the sublayer output lower precision
    for i, (res, norm, g) in enumerate(rest, start=2):
        x = attn_res_norm(
            sources[:i],
            res.query,
            res.key_norm.weight,
            res.eps,
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            latest=latest,  # stored into its slot by the kernel that reads it first
            backend="torch" if backend == "torch" else "auto",
        )
        if g is None:
            return x
        latest = g(x).to(sources.dtype)
    raise AssertionError("unreachable: the last step has g None")


def full_attn_res_stream(embedding: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    """Full AttnRes through the fused ops: step l reads RMSNorm_l(AttnRes_l(embedding, y_0, ..., y_{l-1})).

    The steps after the first form one stream (`ops.attnres.full_stream`), whose backward assembles each source's
    gradient once instead of returning one gradient per source and step; their AttnRes share one key-norm eps.
    The sources share the dtype of the first sublayer output (under autocast the embedding enters the mixture rounded
    to the autocast dtype, as every sublayer output does). Returns FinalNorm(h_final) [B, T, D].
    """
    (_, norm, g), rest = steps[0], steps[1:]
    x = norm(embedding)
    if g is None:
        return x
    if len({r.eps for r, _, _ in rest}) > 1:
        raise ValueError(f"full_attn_res_stream: the AttnRes share one key-norm eps, got {[r.eps for r, _, _ in rest]}")
    y = g(x).contiguous()
    sources = [embedding.to(y.dtype).contiguous(), y]
    queries = torch.stack([r.query for r, _, _ in rest])
    key_weights = torch.stack([r.key_norm.weight for r, _, _ in rest])
    norm_weights = torch.stack([norm.weight for _, norm, _ in rest])
    res, norm, _ = rest[0]
    x, carrier = attn_res_norm_stream_start(sources, queries, key_weights, norm_weights, res.eps, norm.eps)
    for (_, _, g), (_, norm, _) in itertools.pairwise(rest):  # each output is the next step's newest source
        sources.append(g(x).to(y.dtype).contiguous())
        x, carrier = attn_res_norm_step(sources, carrier, norm.eps)
    return x


def block_attn_res_stream(embedding: torch.Tensor, steps: Sequence[Step], block_size: int) -> torch.Tensor:
    """Block AttnRes through the fused ops, two-phase (docs/math.md, "Attention Residuals").

    Sublayer i belongs to block i // block_size; the final AttnRes joins the last block. Per block, phase 1 runs once
    over the completed block sums b_0 = embedding, b_1, ... for all its AttnRes queries; then each sublayer merges in
    the partial sum of its own block (the one that opens the block has none) and is normalised. The first step, with
    one source, is the plain pre-norm. Returns FinalNorm(h_final) [B, T, D].
    """
    if block_size < 1:
        raise ValueError(f"block_attn_res_stream: block_size must be >= 1, got {block_size}")
    (_, norm, g) = steps[0]
    x = norm(embedding)
    if g is None:
        return x
    y = g(x)
    blocks, partial = [embedding.to(y.dtype)], y
    n = len(steps) - 1  # steps 1 .. n by block (the first ran above); the final AttnRes n joins the last block
    for _, members in itertools.groupby(range(1, n + 1), key=lambda i: min(i, n - 1) // block_size):
        group = list(members)
        if group[0] % block_size == 0 and group[0] > 0:
            blocks.append(partial)
            partial = None
        res_group = [steps[i][0] for i in group]
        if any(r.eps != res_group[0].eps for r in res_group):
            raise ValueError(
                f"block_attn_res_stream: a block's AttnRes share one key-norm eps, got {[r.eps for r in res_group]}"
            )
        queries = torch.stack([r.query for r in res_group])
        key_weights = torch.stack([r.key_norm.weight for r in res_group])
        out, lse = attn_res_partial_train(blocks, queries, key_weights, res_group[0].eps)
        for i, o, s in zip(group, out, lse.unbind(0), strict=True):
            res, norm, g = steps[i]
            dtype = blocks[-1].dtype if partial is None else partial.dtype
            x = attn_res_merge_norm_train(
                o, s, partial, res.query, res.key_norm.weight, norm.weight, res.eps, norm.eps, dtype=dtype
            )
            if g is None:
                return x
            y = g(x).to(blocks[0].dtype)
            partial = y if partial is None else partial + y
    raise AssertionError("unreachable: the final AttnRes is in the last block")
