"""SwiGLU's product SiLU(a) * b for training, one Triton kernel each way, from the packed projection [a | b].

    y = round(SiLU(a)) * b,     da = dy b s (1 + a (1 - s)),     db = dy round(SiLU(a)),     s = sigmoid(a)

in float32 (float64 for float64 inputs), rounded where the eager `F.silu(a) * b` rounds (docs/math.md, "SwiGLU
product"). The input is one [..., 2F] tensor, a = its first F columns and b the last F: the output of one matmul
against the gate and up weights stacked. The backward writes da and db into one [..., 2F] gradient, which is that
matmul's output gradient as it is (separate a and b would need a concatenation). Autograd keeps the input only
(eager autograd also keeps SiLU(a)); eager PyTorch runs two kernels forward and about eight backward.

Eager calls run an autograd Function; under `torch.compile` the same kernels run as custom ops with fake
implementations, so `torch.compile(fullgraph=True)` traces them as opaque nodes. `layers.mlp.SwiGLU`
uses it in training on CUDA (the rule of `hybrid_attention.backends`); its eager code is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybrid_attention.ops.act_mul import _act_mul_kernel
from hybrid_attention.ops.attnres.rows import compute_tl_dtype
from hybrid_attention.ops.triton_support import as_rows, interpreting, triton_available, triton_runs_on

BLOCK = 1024  # columns per program


@triton.jit
def _swiglu_bwd_kernel(gu, dy, dgu, width, stride_gu, stride_dy, BLOCK: tl.constexpr, CDT: tl.constexpr):
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


def _grid(n: int, width: int) -> tuple[int, int]:
    return (n, triton.cdiv(width, BLOCK))


def _forward(gate_up: Tensor) -> Tensor:
    """[..., 2F] -> [..., F] in gate_up's dtype."""
    width = gate_up.shape[-1] // 2
    gu = as_rows(gate_up, 2 * width)
    y = gate_up.new_empty(*gate_up.shape[:-1], width)
    if y.numel():
        _act_mul_kernel[_grid(gu.shape[0], width)](
            gu, gu[:, width:], y, width, gu.stride(0), gu.stride(0), SILU=True, BLOCK=BLOCK,
            CDT=compute_tl_dtype(gate_up.dtype),
        )  # fmt: skip
    return y


def _backward_kernel(dy: Tensor, gate_up: Tensor) -> Tensor:
    """[..., F], [..., 2F] -> d gate_up [..., 2F] in gate_up's dtype."""
    width = gate_up.shape[-1] // 2
    gu, g = as_rows(gate_up, 2 * width), as_rows(dy, width)
    dgu = torch.empty(gate_up.shape, device=gate_up.device, dtype=gate_up.dtype)
    if dgu.numel():
        _swiglu_bwd_kernel[_grid(gu.shape[0], width)](
            gu, g, dgu, width, gu.stride(0), g.stride(0), BLOCK=BLOCK, CDT=compute_tl_dtype(gate_up.dtype)
        )
    return dgu


# Eager calls launch the kernels from an autograd Function (a custom op's dispatch costs more host time than these
# kernels take on the GPU); torch.compile traces the custom ops below, which run the same two functions.
class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _forward(gate_up)

    @staticmethod
    def backward(ctx, dy):
        return _backward_kernel(dy, *ctx.saved_tensors)


@torch.library.custom_op("hybrid_attention::swiglu_fwd", mutates_args=())
def _fwd_op(gate_up: Tensor) -> Tensor:
    """[..., 2F] -> [..., F] in gate_up's dtype."""
    return _forward(gate_up)


@_fwd_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("hybrid_attention::swiglu_bwd", mutates_args=())
def _bwd_op(dy: Tensor, gate_up: Tensor) -> Tensor:
    """[..., F], [..., 2F] -> d gate_up [..., 2F] in gate_up's dtype."""
    return _backward_kernel(dy, gate_up)


@_bwd_op.register_fake
def _(dy, gate_up):
    return torch.empty_like(gate_up)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return _bwd_op(dy, gate_up)


_fwd_op.register_autograd(_backward, setup_context=_setup)


def swiglu_fused_supported(x: Tensor) -> bool:
    """The kernels take x: a Triton dtype on CUDA or under the interpreter (there float64 too, for tests)."""
    if not triton_available():
        return False
    return triton_runs_on(x) or (x.dtype == torch.float64 and x.device.type == "cpu" and interpreting())


def swiglu_fused(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2F] (each row with unit stride; a = [..., :F], b = [..., F:]) -> SiLU(a) * b [..., F] in its
    dtype, as `F.silu(a) * b` computes it, differentiable (the backward keeps gate_up only)."""
    if not swiglu_fused_supported(gate_up) or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"swiglu_fused: needs triton and a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1) of float16, "
            f"bfloat16 or float32 (float64 under the interpreter) of shape [..., 2F]; got {gate_up.dtype} "
            f"{tuple(gate_up.shape)} on {gate_up.device}"
        )
    if torch.compiler.is_compiling():
        return _fwd_op(gate_up)
    return _SwiGLUFn.apply(gate_up)
