"""Causal depthwise short convolution (kernel 4 in KDA) followed by SiLU, with a decoding cache of the last W - 1
inputs; Triton kernels on CUDA, this eager path their reference (docs/kernels.md, "Around the op").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.ops.backends import use_triton


def _fused_taps() -> int:
    """The longest kernel the Triton kernels take (imported late: triton is needed only on this path)."""
    from hybrid_attention.ops.short_conv import TAPS

    return TAPS


class ShortConv(nn.Module):
    """y_t = SiLU(sum_{j<W} w_j x_{t-W+1+j}), per channel, causal, no bias."""

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConv: kernel_size must be >= 1, got {kernel_size}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def empty_cache(self, batch_size: int, device=None, dtype=None) -> torch.Tensor:
        """Zeros `[B, C, W - 1]`: the left context of a sequence that has not started."""
        device = device if device is not None else self.weight.device
        dtype = dtype if dtype is not None else self.weight.dtype
        return torch.zeros(batch_size, self.channels, self.kernel_size - 1, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, *, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]. With `cache` ([B, C, W-1]) it is the left context, updated in place.
        `positions` (int [B, T], packed documents, no cache): each token's position in its document; no tap reaches
        before a document's first token."""
        B, T, C = x.shape
        if C != self.channels:
            raise ValueError(f"ShortConv: expected {self.channels} channels, got input of shape {tuple(x.shape)}")
        if cache is not None and cache.shape != (B, C, self.kernel_size - 1):
            raise ValueError(f"ShortConv: cache shape {tuple(cache.shape)} != expected {(B, C, self.kernel_size - 1)}")
        if positions is not None and cache is not None:
            raise ValueError("ShortConv: packed documents (positions) start from zeros and take no cache")
        if use_triton(x) and self.kernel_size <= _fused_taps():
            return self._fused(x, cache, positions)
        xt = x.transpose(1, 2)  # (B, C, T)
        left = xt.new_zeros(B, C, self.kernel_size - 1) if cache is None else cache.to(x.dtype)
        window = torch.cat([left, xt], dim=-1)  # (B, C, W-1+T)
        if positions is not None:  # tap j of row t reaches W - 1 - j tokens back: zero where that leaves the document
            taps = window.unfold(-1, self.kernel_size, 1)  # (B, C, T, W)
            reach = torch.arange(self.kernel_size - 1, -1, -1, device=x.device)
            inside = reach <= positions[:, None, :, None].to(reach.dtype)  # (B, 1, T, W)
            y = (taps * inside * self.weight.to(x.dtype).view(1, C, 1, self.kernel_size)).sum(-1)
            return F.silu(y).transpose(1, 2)
        y = F.conv1d(window, self.weight.to(x.dtype), groups=C)  # (B, C, T)
        if cache is not None and self.kernel_size > 1:
            cache.copy_(window[..., -(self.kernel_size - 1) :])
        return F.silu(y).transpose(1, 2)

    def _fused(
        self, x: torch.Tensor, cache: torch.Tensor | None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The Triton kernel, with or without a cache. A cached prefill runs the same kernel as the whole-prompt
        forward (its left context prepended), so both give the same numbers; cuDNN's conv1d may use TF32."""
        from hybrid_attention.ops.short_conv import short_conv

        weight = self.weight.view(self.channels, self.kernel_size)
        if cache is None:
            return short_conv(x, weight, positions)
        left = self.kernel_size - 1
        window = torch.cat([cache.transpose(1, 2).to(x.dtype), x], dim=1)  # (B, W-1+T, C)
        y = short_conv(window, weight)[:, left:]
        if left > 0:
            cache.copy_(window[:, -left:].transpose(1, 2))
        return y

    def step(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """One decoding step: x [B, C], cache [B, C, W-1] updated in place -> y [B, C]."""
        window = torch.cat([cache.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # (B, C, W)
        y = (window * self.weight.squeeze(1).to(x.dtype)).sum(-1)
        if self.kernel_size > 1:
            cache.copy_(window[..., 1:])
        return F.silu(y)
