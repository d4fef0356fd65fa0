"""Attention Residuals: one learned softmax over depth in place of the residual sum (docs/math.md; arXiv 2603.15031).

Each sublayer l (attention or MLP) and the final output norm own one `AttnRes`: a pseudo-query `w_l` [D] and a
key RMSNorm weight `gamma_l` [D]. The sublayer input is h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i over the
sources (embedding and earlier sublayer outputs, or block sums for Block AttnRes). `w_l` starts at zero, so the
layer starts as the plain mean of its sources; the math is in `hybrid_attention.ops.attnres.naive`.

`attn_res_stream` and `block_attn_res_stream` run a whole residual stream (Full or Block AttnRes) through the fused
differentiable ops of `ops.attnres.stream_train` and `ops.attnres.fused_train`, each AttnRes fused with the RMSNorm
of the sublayer that reads it: every source is kept once (the sublayer outputs themselves, never stacked), Full
AttnRes assembles each source's gradient once, in the backward of its first reader, and Block AttnRes takes the
two-phase form (phase 1 once per block for all its sublayers, then an exact merge of the block's partial sum).
The sources share one dtype, that of the first sublayer output: under autocast the embedding enters the depth
mixture rounded to the autocast dtype, as every sublayer output does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.ops.attnres.full_train import attn_res_norm_train
from hybrid_attention.ops.attnres.fused_train import attn_res_merge_norm_train, attn_res_partial_train
from hybrid_attention.ops.attnres.naive import attn_res, attn_res_merge, attn_res_partial, attn_res_weights
from hybrid_attention.ops.attnres.stream_train import attn_res_norm_step, attn_res_norm_stream_start

# One step of a residual stream: (the AttnRes that builds the input, the RMSNorm that reads it, the sublayer g
# taking the normalised input to its output); the final step has g None (its norm is the output norm).
Step = tuple["AttnRes", RMSNorm, Callable[[torch.Tensor], torch.Tensor] | None]


class AttnRes(nn.Module):
    """Depth attention for one sublayer. Parameters: `query` [D] (zeros, no weight decay), `key_norm.weight` [D]."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"AttnRes: hidden_size must be >= 1, got {hidden_size}")
        self.hidden_size = hidden_size
        # Zero init: uniform weights over the sources at step 0 (the paper reports this avoids early volatility).
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.query._no_weight_decay = True
        # Only its weight is used (as gamma in the logits); the sources themselves are never normalised.
        self.key_norm = RMSNorm(hidden_size, eps=eps)

    @property
    def eps(self) -> float:
        return self.key_norm.eps

    def _check(self, sources: torch.Tensor | Sequence[torch.Tensor]) -> None:
        widths = {sources.shape[-1]} if isinstance(sources, torch.Tensor) else {s.shape[-1] for s in sources}
        if widths and widths != {self.hidden_size}:
            raise ValueError(f"AttnRes: sources must have last dimension {self.hidden_size}, got {sorted(widths)}")

    def forward(self, sources: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """sources: S x [B, T, D] (or stacked [S, B, T, D]) -> h [B, T, D] in the sources' dtype."""
        self._check(sources)
        return attn_res(sources, self.query, self.key_norm.weight, self.eps)

    def weights(self, sources: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Depth-softmax probabilities [S, B, T] (float32, float64 for float64 sources), for inspection."""
        self._check(sources)
        return attn_res_weights(sources, self.query, self.key_norm.weight, self.eps)

    def partial(self, blocks: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block AttnRes phase 1 over completed blocks -> (out [B, T, D], lse [B, T]) in float32 (float64)."""
        self._check(blocks)
        return attn_res_partial(blocks, self.query, self.key_norm.weight, self.eps)

    def merge(self, out: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """Block AttnRes phase 2: fold the block's running sum `partial` [B, T, D] in -> h [B, T, D]."""
        self._check([partial])
        return attn_res_merge(out, lse, partial, self.query, self.key_norm.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def attn_res_stream(embedding: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    """Full AttnRes through the fused ops: step l reads RMSNorm_l(AttnRes_l(embedding, y_0, ..., y_{l-1})).

    The first step reads the embedding alone; the others form one stream (`ops.attnres.stream_train`), whose
    backward assembles each source's gradient once instead of returning one gradient per source and step. Its
    AttnRes share one key-norm eps.

    Args:
        embedding: [B, T, D], source 0.
        steps: one (attn_res, norm, g) per sublayer, in order, then (final_res, final_norm, None).

    Returns:
        FinalNorm(h_final) [B, T, D].
    """
    if not steps or steps[-1][2] is not None or any(g is None for _, _, g in steps[:-1]):
        raise ValueError("attn_res_stream: expected steps ending with the final AttnRes, the only one with g None")
    (res, norm, g), rest = steps[0], steps[1:]
    if len({r.eps for r, _, _ in rest}) > 1:
        raise ValueError(f"attn_res_stream: the AttnRes share one key-norm eps, got {[r.eps for r, _, _ in rest]}")
    # The first step reads the embedding alone, in its own dtype.
    x = attn_res_norm_train([embedding], res.query, res.key_norm.weight, norm.weight, res.eps, norm.eps)
    if g is None:
        return x
    y = g(x).contiguous()
    # The first output fixes the sources' dtype (the autocast dtype under autocast).
    sources = [embedding.to(y.dtype).contiguous(), y]
    queries = torch.stack([r.query for r, _, _ in rest])
    key_weights = torch.stack([r.key_norm.weight for r, _, _ in rest])
    norm_weights = torch.stack([norm.weight for _, norm, _ in rest])
    res, norm, _ = rest[0]
    x, carrier = attn_res_norm_stream_start(sources, queries, key_weights, norm_weights, res.eps, norm.eps)
    # Each step's sublayer output is the newest source of the next step.
    for (_, _, g), (_, norm, _) in itertools.pairwise(rest):
        sources.append(g(x).to(y.dtype).contiguous())
        x, carrier = attn_res_norm_step(sources, carrier, norm.eps)
    return x


def block_attn_res_stream(embedding: torch.Tensor, steps: Sequence[Step], block_size: int) -> torch.Tensor:
    """Block AttnRes through the fused ops, two-phase (docs/math.md, "Attention Residuals").

    Sublayer i belongs to block i // block_size; the final AttnRes joins the last block. Per block, phase 1 runs
    once over the completed block sums b_0 = embedding, b_1, ... for all its AttnRes queries; then each sublayer
    merges in the partial sum of its own block (the one that opens the block has none) and is normalised.

    Args:
        embedding: [B, T, D], b_0.
        steps: one (attn_res, norm, g) per sublayer, in order, then (final_res, final_norm, None).
        block_size: sublayers per block (1 is Full AttnRes).

    Returns:
        FinalNorm(h_final) [B, T, D].
    """
    if block_size < 1 or not steps or steps[-1][2] is not None:
        raise ValueError(
            f"block_attn_res_stream: expected block_size >= 1 and steps ending with the final AttnRes (g None), got "
            f"block_size={block_size} and {len(steps)} steps"
        )
    n = len(steps) - 1
    groups = [list(range(k, min(k + block_size, n))) for k in range(0, n, block_size)] or [[]]
    groups[-1].append(n)
    blocks = [embedding]
    for group in groups:
        res_group = [steps[i][0] for i in group]
        eps = res_group[0].eps
        if any(r.eps != eps for r in res_group):
            raise ValueError(
                f"block_attn_res_stream: a block's AttnRes share one key-norm eps, got {[r.eps for r in res_group]}"
            )
        queries = torch.stack([r.query for r in res_group])
        key_weights = torch.stack([r.key_norm.weight for r in res_group])
        out, lse = attn_res_partial_train(blocks, queries, key_weights, eps)
        partial = None
        for i, o, s in zip(group, out, lse.unbind(0), strict=True):
            res, norm, g = steps[i]
            dtype = blocks[-1].dtype if partial is None else partial.dtype
            x = attn_res_merge_norm_train(
                o, s, partial, res.query, res.key_norm.weight, norm.weight, res.eps, norm.eps, dtype=dtype
            )
            if g is None:
                return x
            y = g(x)
            if len(blocks) == 1 and partial is None:  # the first output fixes the sources' dtype
                blocks = [embedding.to(y.dtype)]
            y = y.to(blocks[0].dtype)
            partial = y if partial is None else partial + y
        blocks.append(partial)
    raise AssertionError("unreachable: the final AttnRes is in the last block")
