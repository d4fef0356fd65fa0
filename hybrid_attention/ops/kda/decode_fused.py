"""Fused one-token KDA decode pieces around the recurrence: inputs (conv + SiLU + L2 norm + gate + beta) and the
gated output norm. Inference only, used by `KimiDeltaAttention` when it decodes one token on CUDA.

Per head, for the token's projections (DESIGN.md "Layers", MATH.md "KDA recurrence"):

    q, k, v = SiLU(conv_step(W_q x)), SiLU(conv_step(W_k x)), SiLU(conv_step(W_v x))   conv tails updated in place
    q, k    = q / ||q||, k / ||k||                     (float32, eps 1e-6 inside the root)
    g       = lower_bound * sigmoid(exp(A_log_h) * (z + dt_bias))      beta = sigmoid(b)
    ...       the recurrence (ops.kda: recurrent_kda) ...
    y       = RMSNorm_head(o) * sigmoid(gate)

Eager PyTorch runs these as about 60 small kernels per layer and token; here they are two (the output norm is
the forward kernel of `ops.gated_norm`). Rounding follows the
eager layer step by step (the conv output, the SiLU output and the normalised q/k are rounded to the activation
dtype, the RMSNorm output before the gate), so the two paths agree to float32 precision in float32 and to bf16
rounding in bf16. q, k, v come back in float32 holding those rounded values, which is what the recurrence computes
in anyway (it saves three casts). The inputs kernel runs one program per (sequence, head); the head dim must fit
one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.gated_norm import gated_norm_forward
from hybrid_attention.ops.kda.triton_utils import L2_EPS


@triton.jit
def _conv_silu(x_ptr, tail_ptr, w_ptr, offs, ok, W: tl.constexpr):
    """One causal depthwise conv step over [tail ; x] per channel, tail shifted in place; returns SiLU(y), rounded
    like the eager conv1d + silu in the activation dtype (the dtype of x)."""
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    y = x.to(tl.float32) * tl.load(w_ptr + offs * W + (W - 1), mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        t = tl.load(tail_ptr + offs * (W - 1) + j, mask=ok, other=0.0)
        y += t.to(tl.float32) * tl.load(w_ptr + offs * W + j, mask=ok, other=0.0).to(tl.float32)
    # Shift the tail left by one and append x. When the head is narrower than the program's threads, several warps
    # hold copies of one channel: the barriers keep a lagging copy from reading an element another has shifted.
    tl.debug_barrier()
    for j in tl.static_range(W - 2):
        t = tl.load(tail_ptr + offs * (W - 1) + j + 1, mask=ok)
        tl.debug_barrier()
        tl.store(tail_ptr + offs * (W - 1) + j, t, mask=ok)
    tl.store(tail_ptr + offs * (W - 1) + (W - 2), x, mask=ok)
    y = y.to(x.dtype).to(tl.float32)
    return (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32)


@triton.jit
def _l2_round(x, DTYPE: tl.constexpr):
    return (x * tl.rsqrt(tl.sum(x * x, axis=0) + L2_EPS)).to(DTYPE).to(tl.float32)


@triton.jit
def _decode_inputs_kernel(
    xq_ptr,  # [B, C] projections (stride stride_x between sequences), activation dtype
    xk_ptr,
    xv_ptr,
    b_ptr,  # [B, H] beta logits (stride stride_b)
    z_ptr,  # [B, C] decay logits (stride stride_z)
    tq_ptr,  # [B, C, W - 1] conv tails, contiguous, updated in place
    tk_ptr,
    tv_ptr,
    wq_ptr,  # [C, W] conv weights, contiguous
    wk_ptr,
    wv_ptr,
    a_log_ptr,  # [H]
    dt_bias_ptr,  # [C]
    q_out,  # [B, H, D] float32
    k_out,
    v_out,
    g_out,  # [B, H, D] float32
    beta_out,  # [B, H] float32
    stride_x,
    stride_b,
    stride_z,
    lower_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    C = H * D
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    offs = h * D + d  # channels of this head
    tail = b * C * (W - 1)
    dtype = xq_ptr.dtype.element_ty

    q = _conv_silu(xq_ptr + b * stride_x, tq_ptr + tail, wq_ptr, offs, ok, W)
    k = _conv_silu(xk_ptr + b * stride_x, tk_ptr + tail, wk_ptr, offs, ok, W)
    v = _conv_silu(xv_ptr + b * stride_x, tv_ptr + tail, wv_ptr, offs, ok, W)
    q = _l2_round(tl.where(ok, q, 0.0), dtype)
    k = _l2_round(tl.where(ok, k, 0.0), dtype)

    z = tl.load(z_ptr + b * stride_z + offs, mask=ok, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    g = lower_bound * tl.sigmoid(rate * (z + tl.load(dt_bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)))
    beta = tl.sigmoid(tl.load(b_ptr + b * stride_b + h).to(tl.float32))

    out = (b * H + h) * D + d
    tl.store(q_out + out, q, mask=ok)
    tl.store(k_out + out, k, mask=ok)
    tl.store(v_out + out, v, mask=ok)
    tl.store(g_out + out, g, mask=ok)
    tl.store(beta_out + b * H + h, beta)


def _rows(x: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """[B, 1, width] or [B, width] -> [B, width] with unit stride in the last dim (a view when possible)."""
    x2 = x.reshape(x.shape[0], -1)
    if x2.shape[1] != width:
        raise ValueError(f"kda decode: {name} must hold {width} values per sequence, got shape {tuple(x.shape)}")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def kda_decode_inputs(
    q_in: torch.Tensor,
    k_in: torch.Tensor,
    v_in: torch.Tensor,
    b_in: torch.Tensor,
    z: torch.Tensor,
    tails: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    num_heads: int,
    lower_bound: float,
) -> tuple[torch.Tensor, ...]:
    """One-token KDA inputs for B sequences.

    Args:
        q_in, k_in, v_in: [B, 1, H*D] projections (before the conv); z: [B, 1, H*D] decay logits; b_in: [B, 1, H].
        tails: conv tails (q, k, v), each [B, H*D, W-1] contiguous, shifted in place (W = conv kernel size >= 2).
        conv_weights: (q, k, v) conv weights, each [H*D, 1, W].  A_log: [H].  dt_bias: [H*D].
    Returns:
        q, k, v [B, 1, H, D] float32 (q, k L2-normalised; values rounded to the activation dtype like the eager
        layer), g [B, 1, H, D] float32 log decay, beta [B, 1, H] float32.
    """
    B = q_in.shape[0]
    H = num_heads
    C = q_in.shape[-1]
    D = C // H
    W = conv_weights[0].shape[-1]
    if C != H * D or W < 2:
        raise ValueError(f"kda decode: width {C} must be num_heads * head_dim and conv size >= 2 (got {W})")
    xq, xk, xv, zz = (_rows(t, C, n) for t, n in ((q_in, "q_in"), (k_in, "k_in"), (v_in, "v_in"), (z, "z")))
    bb = _rows(b_in, H, "b_in")
    if xk.stride(0) != xq.stride(0) or xv.stride(0) != xq.stride(0):
        xq, xk, xv = xq.contiguous(), xk.contiguous(), xv.contiguous()
    for t in tails:
        if tuple(t.shape) != (B, C, W - 1) or not t.is_contiguous():
            raise ValueError(f"kda decode: conv tails must be contiguous [B, {C}, {W - 1}], got {tuple(t.shape)}")
    weights = [w.reshape(C, W).contiguous() for w in conv_weights]
    f32 = dict(device=q_in.device, dtype=torch.float32)
    q, k, v, g = (torch.empty(B, 1, H, D, **f32) for _ in range(4))
    beta = torch.empty(B, 1, H, **f32)
    _decode_inputs_kernel[(B, H)](
        xq,
        xk,
        xv,
        bb,
        zz,
        *tails,
        *weights,
        A_log,
        dt_bias,
        q,
        k,
        v,
        g,
        beta,
        xq.stride(0),
        bb.stride(0),
        zz.stride(0),
        float(lower_bound),
        H=H,
        D=D,
        W=W,
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=4 if D <= 256 else 8,
    )
    return q, k, v, g, beta


def kda_gated_output_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *, dtype: torch.dtype
) -> torch.Tensor:
    """o [B, 1, H, D] (any float dtype), gate [B, 1, H*D], weight [D] -> [B, 1, H*D] in `dtype`:
    RMSNorm_head(o rounded to dtype) * sigmoid(gate), as `GatedRMSNorm` computes it (the forward kernel of
    `ops.gated_norm`, which rounds its input to the output dtype first)."""
    B, _, H, D = o.shape
    gg = _rows(gate, H * D, "gate").contiguous()
    return gated_norm_forward(o.contiguous(), gg, weight, eps, dtype).view(B, 1, H * D)
