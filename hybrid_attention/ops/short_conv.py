"""Causal depthwise short convolution + SiLU (the KDA q/k/v conv) as streaming Triton kernels, forward and backward,
beside the reference `naive_short_conv` (docs/math.md, "Short convolution"; docs/kernels.md, "Around the op").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybrid_attention.ops.numerics import compute_dtype

TAPS = 4  # the kernels' window: rows t-3 .. t
BC = 512  # channels per program
SEG = 32  # time steps per program
# The backward keeps twice the rows live (x and dp), so it runs best with twice the warps.
FWD_WARPS, BWD_WARPS = 4, 8


def naive_short_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, C], weight [C, W] -> SiLU(causal depthwise conv) [B, T, C], computed in compute_dtype(x) (float64
    for float64 inputs, else float32), returned in x.dtype. positions [B, T] (packed documents): tap j of row t
    reads zero where it reaches before the row's document, i.e. where W - 1 - j > positions[t]."""
    C, W = weight.shape
    ct = compute_dtype(x)
    xt = F.pad(x.to(ct).transpose(1, 2), (W - 1, 0))
    if positions is None:
        return F.silu(F.conv1d(xt, weight.to(ct).unsqueeze(1), groups=C)).transpose(1, 2).to(x.dtype)
    windows = xt.unfold(-1, W, 1)  # (B, C, T, W): tap j of row t is x[t - W + 1 + j]
    reach = torch.arange(W - 1, -1, -1, device=x.device)  # tokens back each tap reads
    inside = reach <= positions[:, None, :, None].to(reach.dtype)  # (B, 1, T, W)
    return F.silu((windows * inside * weight.to(ct)[None, :, None, :]).sum(-1)).transpose(1, 2).to(x.dtype)


@triton.jit
def _load_row(ptr, t, c, T, C):
    """Row t of a [T, C] array at channels c, float32; zero outside the sequence. The row index is broadcast to
    c's shape because the Triton interpreter rejects a scalar mask term."""
    tt = t + tl.zeros_like(c)
    return tl.load(ptr + tt.to(tl.int64) * C + c, mask=(c < C) & (tt >= 0) & (tt < T), other=0.0).to(tl.float32)


@triton.jit
def _store_row(ptr, t, c, T, C, row):
    tt = t + tl.zeros_like(c)
    tl.store(ptr + tt.to(tl.int64) * C + c, row.to(ptr.dtype.element_ty), mask=(c < C) & (tt >= 0) & (tt < T))


@triton.jit
def _load_tap(w, c, C, i: tl.constexpr, W: tl.constexpr):
    """Tap i of the 4 (it multiplies x[t - 3 + i]) for channels c: weight column i - (4 - W), zero for a kernel of
    W < 4 taps where that is negative."""
    if i < 4 - W:
        return tl.zeros(c.shape, dtype=tl.float32)
    else:
        return tl.load(w + c * W + (i - 4 + W), mask=c < C, other=0.0).to(tl.float32)


@triton.jit
def _load_taps(w, c, C, W: tl.constexpr):
    return _load_tap(w, c, C, 0, W), _load_tap(w, c, C, 1, W), _load_tap(w, c, C, 2, W), _load_tap(w, c, C, 3, W)


@triton.jit
def _store_dw(part, c, C, i: tl.constexpr, W: tl.constexpr, dw):
    """Tap i's share of dw into the weight's column i - (4 - W) (nothing for a tap that is not in the kernel)."""
    if i >= 4 - W:
        tl.store(part + (i - 4 + W), dw, mask=c < C)


@triton.jit
def _load_pos(pos, t, c, T):
    """Position of row t in its document (broadcast over the channels c; 0 outside the sequence)."""
    tt = t + tl.zeros_like(c)
    return tl.load(pos + tt, mask=(tt >= 0) & (tt < T), other=0)


@triton.jit
def _conv_fwd_kernel(x, w, y, pos, T, C, W: tl.constexpr, BC: tl.constexpr, SEG: tl.constexpr, VARLEN: tl.constexpr):
    t0 = tl.program_id(0) * SEG
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * T * C
    w0, w1, w2, w3 = _load_taps(w, c, C, W)
    x3 = _load_row(x + base, t0 - 3, c, T, C)  # x3, x2, x1: rows t - 3, t - 2, t - 1
    x2 = _load_row(x + base, t0 - 2, c, T, C)
    x1 = _load_row(x + base, t0 - 1, c, T, C)
    for i in tl.static_range(SEG):
        x0 = _load_row(x + base, t0 + i, c, T, C)
        if VARLEN:  # a tap that reaches before the row's document start reads zero
            p_t = _load_pos(pos + tl.program_id(2).to(tl.int64) * T, t0 + i, c, T)
            p = w0 * tl.where(p_t >= 3, x3, 0.0) + w1 * tl.where(p_t >= 2, x2, 0.0) + w2 * tl.where(p_t >= 1, x1, 0.0)
            p += w3 * x0
        else:
            p = w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
        _store_row(y + base, t0 + i, c, T, C, p * tl.sigmoid(p))
        x3, x2, x1 = x2, x1, x0


@triton.jit
def _conv_bwd_kernel(
    x, w, dy, dx, dw_part, pos, T, C, W: tl.constexpr, BC: tl.constexpr, SEG: tl.constexpr, VARLEN: tl.constexpr
):
    seg = tl.program_id(0)
    t0 = seg * SEG
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    base = b.to(tl.int64) * T * C
    w0, w1, w2, w3 = _load_taps(w, c, C, W)
    x3 = _load_row(x + base, t0 - 3, c, T, C)
    x2 = _load_row(x + base, t0 - 2, c, T, C)
    x1 = _load_row(x + base, t0 - 1, c, T, C)
    d3 = tl.zeros([BC], dtype=tl.float32)  # d3: dp of row u - 3
    # e_j(r) = dp(r) where tap 3 - j of row r reads inside its document (always, without VARLEN): row u - 3's dx
    # takes e1 of row u - 2, e2 of row u - 1 and e3 of row u.
    e1_2 = tl.zeros([BC], dtype=tl.float32)  # e1 of row u - 2
    e1_1 = tl.zeros([BC], dtype=tl.float32)  # e1 of row u - 1
    e2_1 = tl.zeros([BC], dtype=tl.float32)  # e2 of row u - 1
    d2 = tl.zeros([BC], dtype=tl.float32)
    d1 = tl.zeros([BC], dtype=tl.float32)
    dw0 = tl.zeros([BC], dtype=tl.float32)
    dw1 = tl.zeros([BC], dtype=tl.float32)
    dw2 = tl.zeros([BC], dtype=tl.float32)
    dw3 = tl.zeros([BC], dtype=tl.float32)
    # dx of row u - 3 needs dp up to row u, so the walk runs 3 rows past the segment (dp there is recomputed).
    for i in tl.static_range(SEG + 3):
        u = t0 + i
        x0 = _load_row(x + base, u, c, T, C)
        if VARLEN:
            p_u = _load_pos(pos + b.to(tl.int64) * T, u, c, T)
            m1, m2, m3 = p_u >= 1, p_u >= 2, p_u >= 3
            p = w0 * tl.where(m3, x3, 0.0) + w1 * tl.where(m2, x2, 0.0) + w2 * tl.where(m1, x1, 0.0) + w3 * x0
        else:
            p = w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
        sig = tl.sigmoid(p)
        d0 = _load_row(dy + base, u, c, T, C) * sig * (1.0 + p * (1.0 - sig))
        if VARLEN:
            e1, e2, e3 = tl.where(m1, d0, 0.0), tl.where(m2, d0, 0.0), tl.where(m3, d0, 0.0)
            if i < SEG:  # the segment's own rows: its share of dw
                dw0 += x3 * e3
                dw1 += x2 * e2
                dw2 += x1 * e1
                dw3 += x0 * d0
            if i >= 3:
                _store_row(dx + base, u - 3, c, T, C, w3 * d3 + w2 * e1_2 + w1 * e2_1 + w0 * e3)
            e1_2, e1_1 = e1_1, e1
            e2_1 = e2
        else:
            if i < SEG:
                dw0 += x3 * d0
                dw1 += x2 * d0
                dw2 += x1 * d0
                dw3 += x0 * d0
            if i >= 3:
                _store_row(dx + base, u - 3, c, T, C, w3 * d3 + w2 * d2 + w1 * d1 + w0 * d0)
        x3, x2, x1 = x2, x1, x0
        d3, d2, d1 = d2, d1, d0
    part = dw_part + ((b * tl.num_programs(0) + seg).to(tl.int64) * C + c) * W
    _store_dw(part, c, C, 0, W, dw0)
    _store_dw(part, c, C, 1, W, dw1)
    _store_dw(part, c, C, 2, W, dw2)
    _store_dw(part, c, C, 3, W, dw3)


def _grid(B: int, T: int, C: int) -> tuple[int, int, int]:
    return (triton.cdiv(T, SEG), triton.cdiv(C, BC), B)


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, positions):
        B, T, C = x.shape
        y = torch.empty_like(x)
        varlen = positions is not None
        pos = positions if varlen else x  # never read without VARLEN
        _conv_fwd_kernel[_grid(B, T, C)](
            x, weight, y, pos, T, C, W=weight.shape[-1], BC=BC, SEG=SEG, VARLEN=varlen, num_warps=FWD_WARPS
        )
        ctx.save_for_backward(x, weight, positions)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, positions = ctx.saved_tensors
        B, T, C = x.shape
        W = weight.shape[-1]
        grid = _grid(B, T, C)
        dx = torch.empty_like(x)
        dw_part = torch.empty(B * grid[0], C, W, device=x.device, dtype=torch.float32)
        varlen = positions is not None
        _conv_bwd_kernel[grid](
            x,
            weight,
            dy.contiguous(),
            dx,
            dw_part,
            positions if varlen else x,
            T,
            C,
            W=W,
            BC=BC,
            SEG=SEG,
            VARLEN=varlen,
            num_warps=BWD_WARPS,
        )
        return dx, dw_part.sum(0).to(weight.dtype), None


def short_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, C] (fp16 / bf16 / fp32, CUDA or the Triton interpreter), weight [C, W] with W <= 4 -> y [B, T, C]
    in x.dtype, differentiable in x and weight. Same result as `naive_short_conv` (float32 inside).

    positions: int32 [B, T], each token's position in its document (packed documents): a tap never reaches before a
    document's first token, as if every document started from zeros."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"short_conv: x must be [B, T, C] and weight [C, W], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= weight.shape[-1] <= TAPS:
        raise ValueError(f"short_conv: the kernels take 1 to {TAPS} taps, got a kernel of size {weight.shape[-1]}")
    if positions is not None:
        if positions.shape != x.shape[:2] or positions.device != x.device:
            raise ValueError(
                f"short_conv: positions must be [B, T] = {tuple(x.shape[:2])} on {x.device}, got "
                f"{tuple(positions.shape)} on {positions.device}"
            )
        positions = positions.to(torch.int32).contiguous()
    return _ShortConvFn.apply(x.contiguous(), weight.contiguous(), positions)
