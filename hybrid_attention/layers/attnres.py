"""Attention Residuals: one learned softmax over depth in place of the residual sum (docs/math.md; arXiv 2603.15031).
`AttnRes` owns one sublayer's pseudo-query and key-norm weight; layers/stream.py runs a whole stream of them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.ops.attnres.naive import (
    naive_attn_res,
    naive_attn_res_merge,
    naive_attn_res_partial,
    naive_attn_res_weights,
)


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
        return naive_attn_res(sources, self.query, self.key_norm.weight, self.eps)

    def weights(self, sources: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Depth-softmax probabilities [S, B, T] (float32, float64 for float64 sources), for inspection."""
        self._check(sources)
        return naive_attn_res_weights(sources, self.query, self.key_norm.weight, self.eps)

    def partial(self, blocks: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block AttnRes phase 1 over completed blocks -> (out [B, T, D], lse [B, T]) in float32 (float64)."""
        self._check(blocks)
        return naive_attn_res_partial(blocks, self.query, self.key_norm.weight, self.eps)

    def merge(self, out: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """Block AttnRes phase 2: fold the block's running sum `partial` [B, T, D] in -> h [B, T, D]."""
        self._check([partial])
        return naive_attn_res_merge(out, lse, partial, self.query, self.key_norm.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
