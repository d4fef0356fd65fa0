"""Fused one-token KDA decode pieces around the recurrence: the inputs (decay up projection, conv, SiLU, L2 norm, gate,
beta) and the gated output norm, inference only (docs/kernels.md, "Decode step").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.kda.gate import FUSED_FORMS, check_gate
from hybrid_attention.ops.kda.triton_utils import L2_EPS
from hybrid_attention.ops.triton_support import as_rows


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
def _matvec(w_ptr, x_ptr, rows, ok, R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """sum_r w[rows, r] x[r] for this head's rows of a contiguous [*, R] weight, float32 (the low-rank up
    projections: a [D, R] slice per head, read in [D, BLOCK_R] tiles)."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < R
        w = tl.load(w_ptr + rows[:, None] * R + rr[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        xr = tl.load(x_ptr + rr, mask=r_ok, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xr[None, :], axis=1)
    return acc


@triton.jit
def _decode_output_kernel(
    o_ptr,  # [B, H, D] recurrence output (any float dtype), contiguous
    g_ptr,  # [B, R] low-rank gate input g_down x (stride stride_g)
    gup_ptr,  # [C, R] g_up weight, contiguous
    gup_b_ptr,  # [C] g_up bias (unused without HAS_BIAS)
    nw_ptr,  # [D] the per-head RMSNorm weight
    y_ptr,  # [B, C] output, activation dtype
    stride_g,
    eps,
    HAS_BIAS: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y = round(RMSNorm(round(o)) * w) * sigmoid(round(g_up (g_down x) + bias)) for one (sequence, head), rounded
    as `GatedRMSNorm` and the eager g_up (round = to the output dtype)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    offs = h * D + d
    dt = y_ptr.dtype.element_ty
    x = tl.load(o_ptr + (b * H + h) * D + d, mask=ok, other=0.0).to(dt).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y1 = (x * rstd * tl.load(nw_ptr + d, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    gate = _matvec(gup_ptr, g_ptr + b * stride_g, offs, ok, R, BLOCK_D, BLOCK_R)
    if HAS_BIAS:
        gate += tl.load(gup_b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    gate = gate.to(dt).to(tl.float32)
    tl.store(y_ptr + b * (H * D) + offs, (y1 * tl.sigmoid(gate)).to(dt), mask=ok)


@triton.jit
def _decode_inputs_kernel(
    xq_ptr,  # [B, C] projections (stride stride_x between sequences), activation dtype
    xk_ptr,
    xv_ptr,
    b_ptr,  # [B, H] beta logits (stride stride_b)
    f_ptr,  # [B, R] low-rank decay input f_down x (stride stride_f)
    fup_ptr,  # [C, R] f_up weight, contiguous: the decay logits are z = f_up (f_down x)
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
    stride_f,
    lower_bound,
    SOFTPLUS: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
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

    z = _matvec(fup_ptr, f_ptr + b * stride_f, offs, ok, R, BLOCK_D, BLOCK_R).to(dtype).to(tl.float32)  # as f_up rounds
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    u = z + tl.load(dt_bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if SOFTPLUS:
        g = -rate * tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(tl.minimum(u, 20.0))))
    else:
        g = lower_bound * tl.sigmoid(rate * u)
    beta = tl.sigmoid(tl.load(b_ptr + b * stride_b + h).to(tl.float32))

    out = (b * H + h) * D + d
    tl.store(q_out + out, q, mask=ok)
    tl.store(k_out + out, k, mask=ok)
    tl.store(v_out + out, v, mask=ok)
    tl.store(g_out + out, g, mask=ok)
    tl.store(beta_out + b * H + h, beta)


def _rows(x: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """[B, 1, width] or [B, width] -> [B, width] with unit stride in the last dim (a view when possible)."""
    if x.numel() != x.shape[0] * width:
        raise ValueError(f"kda decode: {name} must hold {width} values per sequence, got shape {tuple(x.shape)}")
    return as_rows(x, width)


def _per_head_launch(H: int, D: int, R: int) -> dict:
    """Sizes and warps of the two decode kernels (one program per (sequence, head), the head in one block, the
    up projection's rank R in tiles of up to 32)."""
    BLOCK_D = triton.next_power_of_2(D)
    return dict(
        H=H, D=D, R=R, BLOCK_D=BLOCK_D, BLOCK_R=min(32, triton.next_power_of_2(R)), num_warps=4 if D <= 256 else 8
    )


def _up_weight(weight: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A low-rank up projection's weight [rows, R], contiguous (the kernels read it row-major)."""
    if weight.dim() != 2 or weight.shape[0] != rows:
        raise ValueError(f"kda decode: {name} must be [{rows}, rank], got {tuple(weight.shape)}")
    return weight.contiguous()


def kda_decode_inputs(
    q_in: torch.Tensor,
    k_in: torch.Tensor,
    v_in: torch.Tensor,
    b_in: torch.Tensor,
    f_in: torch.Tensor,
    f_up_weight: torch.Tensor,
    tails: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    num_heads: int,
    gate: str = "bounded",
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """One-token KDA inputs for B sequences.

    Args:
        q_in, k_in, v_in: [B, 1, H*D] projections (before the conv); b_in: [B, 1, H].
        f_in: [B, 1, R] the decay's down projection; f_up_weight: [H*D, R]: the decay logits z = f_up_weight f_in
            are computed here (rounded to the activation dtype, as the eager f_up), one [D, R] slice per head.
        tails: conv tails (q, k, v), each [B, H*D, W-1] contiguous, shifted in place (W = conv kernel size >= 2).
        conv_weights: (q, k, v) conv weights, each [H*D, 1, W].  A_log: [H].  dt_bias: [H*D].
        gate: "bounded" (with lower_bound; None: -5) or "softplus" (see `kda_gate`).
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
    lb = check_gate(gate, A_log, dt_bias, lower_bound, H=H, K=D, name="kda decode", allowed=FUSED_FORMS)
    xq, xk, xv = (_rows(t, C, n) for t, n in ((q_in, "q_in"), (k_in, "k_in"), (v_in, "v_in")))
    fup = _up_weight(f_up_weight, C, "f_up_weight")
    R = fup.shape[1]
    ff = _rows(f_in, R, "f_in")
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
        ff,
        fup,
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
        ff.stride(0),
        lb,
        SOFTPLUS=gate == "softplus",
        W=W,
        **_per_head_launch(H, D, R),
    )
    return q, k, v, g, beta


def kda_gated_output_norm(
    o: torch.Tensor,
    g_in: torch.Tensor,
    g_up_weight: torch.Tensor,
    g_up_bias: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    dtype: torch.dtype,
) -> torch.Tensor:
    """o [B, 1, H, D] (any float dtype), g_in [B, 1, R] the gate's down projection, g_up_weight [H*D, R], g_up_bias
    [H*D] or None, weight [D] -> [B, 1, H*D] in `dtype`: RMSNorm_head(o rounded to dtype) * sigmoid(gate) with
    gate = g_up_weight g_in + g_up_bias rounded to dtype, as the eager g_up and `GatedRMSNorm` compute it."""
    B, _, H, D = o.shape
    gup = _up_weight(g_up_weight, H * D, "g_up_weight")
    R = gup.shape[1]
    gg = _rows(g_in, R, "g_in")
    y = torch.empty(B, 1, H * D, device=o.device, dtype=dtype)
    _decode_output_kernel[(B, H)](
        o.contiguous(),
        gg,
        gup,
        g_up_bias if g_up_bias is not None else gup,
        weight,
        y,
        gg.stride(0),
        float(eps),
        HAS_BIAS=g_up_bias is not None,
        **_per_head_launch(H, D, R),
    )
    return y
