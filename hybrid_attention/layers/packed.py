"""The projections of a layer that read the same input, run as one product: at decode time over packed copies made once
by `DecodeStep` (docs/inference.md, "A decode step"), in training over the weights concatenated afresh every step
(docs/training.md, "Packed projections in training"). The parameters themselves stay separate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.ops.backends import check_backend, needs_grad, use_triton
from hybrid_attention.ops.numerics import matmul_input_dtype
from hybrid_attention.ops.triton_support import triton_available

_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def decode_gemv_enabled(x: torch.Tensor, gemv: str = "auto") -> bool:
    """Whether decode-step products of `x` go to `ops.gemv`: gemv="triton" always (the interpreter on CPU),
    "torch" never (F.linear), "auto" by the rule of `hybrid_attention.ops.backends` (on CUDA, where it beats cuBLAS's
    batch-1 GEMVs)."""
    return gemv == "triton" or (gemv == "auto" and use_triton(x))


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemv: str = "auto"
) -> torch.Tensor:
    """F.linear, or the decode GEMV kernel (`ops.gemv`) when `decode_gemv_enabled(x, gemv)` and it takes these
    tensors."""
    if decode_gemv_enabled(x, gemv) and triton_available():
        from hybrid_attention.ops.gemv import gemv, gemv_applies  # imports triton

        if gemv_applies(x, weight):
            return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _act_mul_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`ops.act_mul` (no backward) takes a and b: one dtype, and the rule of `hybrid_attention.ops.backends`."""
    return a.dtype == b.dtype and use_triton(a, needs_backward=torch.is_grad_enabled())


class PackedLinear:
    """`nn.Linear`s that read the same input, as one weight (and one bias, zeros where a layer has none):
    x [..., in] -> their outputs, in order (products by `decode_linear` with this `gemv` backend)."""

    def __init__(self, linears: Sequence[nn.Linear], gemv: str = "auto"):
        check_backend(gemv, "PackedLinear: gemv")
        if not linears:
            raise ValueError("PackedLinear: needs at least one nn.Linear")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(f"PackedLinear: input widths differ: {[lin.in_features for lin in linears]}")
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        self.bias = None
        if any(lin.bias is not None for lin in linears):
            zeros = lambda lin: lin.weight.new_zeros(lin.out_features)  # noqa: E731
            self.bias = torch.cat([zeros(lin) if lin.bias is None else lin.bias.detach() for lin in linears])
        self.sizes = [lin.out_features for lin in linears]
        self.gemv = gemv

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return decode_linear(x, self.weight, self.bias, self.gemv).split(self.sizes, dim=-1)


class PackedProjections:
    """What a decode step computes its products with: packed copies of every layer's input projections in `model`
    (`module.packed_linears()` names them, in the order the layer unpacks them), every other linear map by
    `decode_linear` on its own weight, and act(a) * b fused. gemv: the backend of every product (see
    `decode_gemv_enabled`)."""

    def __init__(self, model: nn.Module, gemv: str = "auto"):
        check_backend(gemv, "PackedProjections: gemv")
        self.gemv = gemv
        self.by_module = {
            m: PackedLinear(m.packed_linears(), gemv) for m in model.modules() if hasattr(type(m), "packed_linears")
        }

    def inputs(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of `module.packed_linears()` on x, from one product over their packed weights."""
        packed = self.by_module.get(module)
        if packed is None:
            raise ValueError(f"PackedProjections: no packed weights for this {type(module).__name__} (another model's)")
        return packed(x)

    def linear(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """lin(x) by `decode_linear` (the GEMV kernel where `gemv` takes it), from the parameters themselves."""
        return decode_linear(x, lin.weight, lin.bias, self.gemv)

    def nbytes(self) -> int:
        """Bytes of the packed copies (weights and biases)."""
        return sum(
            t.numel() * t.element_size() for p in self.by_module.values() for t in (p.weight, p.bias) if t is not None
        )


def _sharded(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def stack_in_training(x: torch.Tensor, linears: Sequence[nn.Linear]) -> bool:
    """One matmul for `linears` in training (docs/training.md, "Packed projections in training"): several bias-free
    projections, the rule of `hybrid_attention.ops.backends`, a gradient needed, no sharded weight. A converted linear
    (torchao's Float8Linear, `train --fp8`) computes its own product, so a group with one runs module by module."""
    weights = [lin.weight for lin in linears]
    return (
        len(linears) > 1
        and all(type(lin) is nn.Linear and lin.bias is None for lin in linears)
        and use_triton(x)
        and needs_grad(x, *weights)
        and not any(_sharded(w) for w in weights)
    )


def project(module: nn.Module, x: torch.Tensor, decode: PackedProjections | None) -> tuple[torch.Tensor, ...]:
    """The outputs of `module.packed_linears()` (in that order) on x: one call each, or one packed product in a
    decode step and in training on CUDA."""
    if decode is not None:
        return decode.inputs(module, x)
    # The cast each nn.Linear makes under autocast, made once: autograd keeps one copy of x, not one per layer.
    x = x.to(matmul_input_dtype(x))
    linears = module.packed_linears()
    if stack_in_training(x, linears):
        y = F.linear(x, torch.cat([lin.weight for lin in linears]))
        return tuple(t.contiguous() for t in y.split([lin.out_features for lin in linears], dim=-1))
    return tuple(lin(x) for lin in linears)


def linear(lin: nn.Linear, x: torch.Tensor, decode: PackedProjections | None) -> torch.Tensor:
    """lin(x); in a decode step through `decode_linear`."""
    return lin(x) if decode is None else decode.linear(lin, x)


def act_mul(a: torch.Tensor, b: torch.Tensor, act: str, decode: PackedProjections | None) -> torch.Tensor:
    """act(a) * b (SwiGLU's SiLU(gate) * up, Gated MLA's sigmoid(gate) * o): in a decode step, in one Triton kernel
    (`ops.act_mul`, the same rounding as the eager ops) where `_act_mul_ok` says so; else the two eager ops."""
    if decode is not None and _act_mul_ok(a, b):
        from hybrid_attention.ops.act_mul import act_mul as fused  # imports triton

        return fused(a, b, act)
    return _ACTS[act](a) * b
