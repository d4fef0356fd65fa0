"""SwiGLU's product and down projection for training, (SiLU(a) * b) W^T from the packed projection [a | b], keeping
only the packed input and W for the backward (docs/math.md, "SwiGLU product"; docs/kernels.md, "SwiGLU in training").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from hybrid_attention.ops.act_mul import _act_mul_kernel
from hybrid_attention.ops.triton_support import (
    as_rows,
    compute_tl_dtype,
    eager_or_traced,
    interpreting,
    triton_available,
    triton_runs_on,
)

BLOCK = 1024  # columns per program


@triton.jit
def _swiglu_bwd_kernel(
    gu, dy, dgu, y, width, stride_gu, stride_dy, STORE_Y: tl.constexpr, BLOCK: tl.constexpr, CDT: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    av = tl.load(gu + row * stride_gu + cols, mask=ok, other=0.0)
    af = av.to(CDT)
    bf = tl.load(gu + row * stride_gu + width + cols, mask=ok, other=0.0).to(CDT)
    g = tl.load(dy + row * stride_dy + cols, mask=ok, other=0.0).to(CDT)
    s = tl.sigmoid(af)
    silu = (af * s).to(av.dtype).to(CDT)  # the forward multiplied by SiLU(a) rounded to a's dtype
    da = g * bf * s * (1.0 + af * (1.0 - s))
    out = dgu + row * (2 * width) + cols
    tl.store(out, da.to(dgu.dtype.element_ty), mask=ok)
    tl.store(out + width, (g * silu).to(dgu.dtype.element_ty), mask=ok)
    if STORE_Y:  # the forward's product, as _act_mul_kernel computes it
        tl.store(y + row * width + cols, (silu * bf).to(y.dtype.element_ty), mask=ok)


def _grid(n: int, width: int) -> tuple[int, int]:
    return (n, triton.cdiv(width, BLOCK))


def _product(gate_up: Tensor) -> Tensor:
    """[..., 2F] -> SiLU(a) * b [..., F] in gate_up's dtype."""
    width = gate_up.shape[-1] // 2
    gu = as_rows(gate_up, 2 * width)
    y = gate_up.new_empty(*gate_up.shape[:-1], width)
    if y.numel():
        _act_mul_kernel[_grid(gu.shape[0], width)](
            gu,
            gu[:, width:],
            y,
            width,
            gu.stride(0),
            gu.stride(0),
            SILU=True,
            BLOCK=BLOCK,
            CDT=compute_tl_dtype(gate_up.dtype),
        )
    return y


def _product_bwd(dy: Tensor, gate_up: Tensor, keep_y: bool) -> tuple[Tensor, Tensor]:
    """dy [..., F], gate_up [..., 2F] -> (d gate_up [..., 2F], the product y [..., F] or an empty tensor)."""
    width = gate_up.shape[-1] // 2
    gu, g = as_rows(gate_up, 2 * width), as_rows(dy, width)
    dgu = torch.empty(gate_up.shape, device=gate_up.device, dtype=gate_up.dtype)
    y = gate_up.new_empty(*gate_up.shape[:-1], width) if keep_y else gate_up.new_empty(0)
    if dgu.numel():
        _swiglu_bwd_kernel[_grid(gu.shape[0], width)](
            gu,
            g,
            dgu,
            y,
            width,
            gu.stride(0),
            g.stride(0),
            STORE_Y=keep_y,
            BLOCK=BLOCK,
            CDT=compute_tl_dtype(gate_up.dtype),
        )
    return dgu, y


def _forward(gate_up: Tensor, weight: Tensor) -> Tensor:
    """[..., 2F], [O, F] -> [..., O]."""
    return F.linear(_product(gate_up), weight)


def _backward(dout: Tensor, gate_up: Tensor, weight: Tensor, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """dout [..., O] -> (d gate_up [..., 2F], d weight [O, F] or an empty tensor)."""
    dgu, y = _product_bwd(dout @ weight, gate_up, need_weight_grad)
    if not need_weight_grad:
        return dgu, y
    return dgu, dout.reshape(-1, dout.shape[-1]).T @ y.reshape(-1, y.shape[-1])


@torch.library.custom_op("hybrid_attention::swiglu_down_fwd", mutates_args=())
def _fwd_op(gate_up: Tensor, weight: Tensor) -> Tensor:
    """[..., 2F], [O, F] -> [..., O] in gate_up's dtype."""
    return _forward(gate_up, weight)


@_fwd_op.register_fake
def _(gate_up, weight):
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])


def _backward_kernels(dout, gate_up, weight, need_weight_grad):
    return _backward(dout.contiguous(), gate_up, weight, need_weight_grad)


@torch.library.custom_op("hybrid_attention::swiglu_down_bwd", mutates_args=())
def _bwd_op(dout: Tensor, gate_up: Tensor, weight: Tensor, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """[..., O], [..., 2F], [O, F] -> (d gate_up [..., 2F], d weight [O, F] or an empty tensor)."""
    return _backward_kernels(dout, gate_up, weight, need_weight_grad)


@_bwd_op.register_fake
def _(dout, gate_up, weight, need_weight_grad):
    return torch.empty_like(gate_up), (torch.empty_like(weight) if need_weight_grad else weight.new_empty(0))


_fwd_call = eager_or_traced(_fwd_op, _forward)
_bwd_call = eager_or_traced(_bwd_op, _backward_kernels)


class _SwiGLUDownFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, weight):
        ctx.save_for_backward(gate_up, weight)
        return _fwd_call(gate_up, weight)

    @staticmethod
    def backward(ctx, dout):
        dgu, dw = _bwd_call(dout, *ctx.saved_tensors, ctx.needs_input_grad[1])
        return dgu, (dw if ctx.needs_input_grad[1] else None)


def swiglu_down_supported(x: Tensor) -> bool:
    """The kernels take x: a Triton dtype on CUDA or under the interpreter (there float64 too, for tests)."""
    if not triton_available():
        return False
    return triton_runs_on(x) or (x.dtype == torch.float64 and x.device.type == "cpu" and interpreting())


def swiglu_down(gate_up: Tensor, weight: Tensor) -> Tensor:
    """gate_up [..., 2F] (each row with unit stride; a = [..., :F], b = [..., F:]), weight [O, F] of gate_up's dtype
    -> F.linear(SiLU(a) * b, weight) [..., O], as the eager ops compute it, differentiable in both (the backward
    keeps gate_up and weight only)."""
    if not swiglu_down_supported(gate_up) or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"swiglu_down: needs triton and a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1) of float16, "
            f"bfloat16 or float32 (float64 under the interpreter) of shape [..., 2F]; got {gate_up.dtype} "
            f"{tuple(gate_up.shape)} on {gate_up.device}"
        )
    width = gate_up.shape[-1] // 2
    bad_shape = weight.dim() != 2 or weight.shape[1] != width
    if bad_shape or (weight.dtype, weight.device) != (gate_up.dtype, gate_up.device):
        raise ValueError(
            f"swiglu_down: weight must be [O, {width}] of {gate_up.dtype} on {gate_up.device} (gate_up is "
            f"{tuple(gate_up.shape)}); got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    return _SwiGLUDownFn.apply(gate_up, weight)
