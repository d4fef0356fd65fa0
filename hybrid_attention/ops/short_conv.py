"""Causal depthwise short convolution + SiLU (the KDA q/k/v conv) as Triton kernels, forward and backward.

    y[b, t, c] = SiLU(sum_{j < W} w[c, j] x[b, t - W + 1 + j, c])        (x = 0 before the sequence starts)

The layout is the layer's own [B, T, C] (channels contiguous), so no transposes: the forward reads x once and
writes y once. `torch.nn.functional.conv1d` wants [B, C, T] and its depthwise backward is slow, which is why this
is hand-written. The backward recomputes the pre-activation (W shifted loads that hit L1) instead of saving it:

    dp[t] = dy[t] * SiLU'(p[t])     dx[t] = sum_j w[c, j] dp[t + W - 1 - j]     dw[c, j] = sum_t x[t - W + 1 + j] dp[t]

dw is summed per (batch, time block) in the kernel and over those partials by torch. The PyTorch reference is
`short_conv_reference`; `layers.conv.ShortConv` uses these kernels on CUDA for every multi-token call (with a
decoding cache, its left context is prepended).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybrid_attention.ops.numerics import compute_dtype

BT = 64  # time steps per program
BC = 128  # channels per program


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, C], weight [C, W] -> SiLU(causal depthwise conv) [B, T, C], computed in compute_dtype(x) (float64
    for float64 inputs, else float32), returned in x.dtype."""
    C, W = weight.shape
    ct = compute_dtype(x)
    xt = F.pad(x.to(ct).transpose(1, 2), (W - 1, 0))
    return F.silu(F.conv1d(xt, weight.to(ct).unsqueeze(1), groups=C)).transpose(1, 2).to(x.dtype)


@triton.jit
def _pre_activation(x_ptr, w_ptr, t, c, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """sum_j w[c, j] x[t - W + 1 + j, c] for a [BT, BC] tile of rows t (float32; zero outside the sequence)."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        ts = t - (W - 1) + j
        ok = ((ts >= 0) & (ts < T))[:, None] & (c < C)[None, :]
        xs = tl.load(x_ptr + ts[:, None].to(tl.int64) * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += xs * tl.load(w_ptr + c * W + j, mask=c < C, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(x, w, y, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * T * C
    p = _pre_activation(x + base, w, t, c, T, C, W, BT, BC)
    ok = (t < T)[:, None] & (c < C)[None, :]
    tl.store(y + base + t[:, None].to(tl.int64) * C + c[None, :], (p * tl.sigmoid(p)).to(y.dtype.element_ty), mask=ok)


@triton.jit
def _conv_bwd_kernel(x, w, dy, dx, dw_part, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    it = tl.program_id(0)
    t = it * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    base = b.to(tl.int64) * T * C
    cm = c < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(W):  # dp at rows t + s reaches dx[t] through w[:, W - 1 - s]
        u = t + s
        p = _pre_activation(x + base, w, u, c, T, C, W, BT, BC)
        ok = (u < T)[:, None] & cm[None, :]
        g = tl.load(dy + base + u[:, None].to(tl.int64) * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(p)
        dp = g * sig * (1.0 + p * (1.0 - sig))
        acc += dp * tl.load(w + c * W + (W - 1 - s), mask=cm, other=0.0).to(tl.float32)[None, :]
        if s == 0:  # rows t themselves: their share of dw; the x tiles are loaded again (L1 hits), not kept live
            part = dw_part + ((b * tl.num_programs(0) + it).to(tl.int64) * C + c) * W
            for j in tl.static_range(W):
                ts = t - (W - 1) + j
                okj = ((ts >= 0) & (ts < T))[:, None] & cm[None, :]
                xs = tl.load(x + base + ts[:, None].to(tl.int64) * C + c[None, :], mask=okj, other=0.0)
                tl.store(part + j, tl.sum(xs.to(tl.float32) * dp, 0), mask=cm)
    ok = (t < T)[:, None] & cm[None, :]
    tl.store(dx + base + t[:, None].to(tl.int64) * C + c[None, :], acc.to(dx.dtype.element_ty), mask=ok)


def _grid(B: int, T: int, C: int) -> tuple[int, int, int]:
    return (triton.cdiv(T, BT), triton.cdiv(C, BC), B)


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        B, T, C = x.shape
        W = weight.shape[-1]
        y = torch.empty_like(x)
        _conv_fwd_kernel[_grid(B, T, C)](x, weight, y, T, C, W=W, BT=BT, BC=BC, num_warps=4)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        B, T, C = x.shape
        W = weight.shape[-1]
        grid = _grid(B, T, C)
        dx = torch.empty_like(x)
        dw_part = torch.empty(B * grid[0], C, W, device=x.device, dtype=torch.float32)
        _conv_bwd_kernel[grid](x, weight, dy.contiguous(), dx, dw_part, T, C, W=W, BT=BT, BC=BC, num_warps=4)
        return dx, dw_part.sum(0).to(weight.dtype)


def short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] (fp16 / bf16 / fp32, CUDA or the Triton interpreter), weight [C, W] -> y [B, T, C] in x.dtype,
    differentiable in x and weight. Same result as `short_conv_reference` (float32 inside)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"short_conv: x must be [B, T, C] and weight [C, W], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    return _ShortConvFn.apply(x.contiguous(), weight.contiguous())
