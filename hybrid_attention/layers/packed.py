"""Decode-time packing of the projections that read the same input: one matrix-vector product instead of several.

At batch 1 a decode step is mostly small GEMVs, each far below the memory bandwidth, and their number sets the
step's time (docs/performance.md, "Decode step, kernel by kernel"). The projections of one layer that read the same
x (KDA: q, k, v, beta, and the decay and output-gate down projections; Gated MLA: q, the latent down projection,
the shared key and the gate; SwiGLU: gate and up) can be read as one concatenated weight [sum of outputs, in] in one
launch, with the same products.

On CUDA the products run in the decode GEMV kernel of `ops.gemv` instead of cuBLAS, and so do the model's other
linear layers while a step runs (`gemv`, in the vocabulary of `hybrid_attention.backends`: "auto", the default,
takes the kernel by the one rule; "triton" forces it, also on CPU under the interpreter; "torch" keeps cuBLAS).

The parameters stay separate (the optimizer, Muon's per-matrix updates and checkpoints see them as they are). A
`PackedProjections` holds concatenated copies, made once by `graphs.DecodeStep` (whose contract already is that the
weights do not change while it is used), and installs them on the layers only for the duration of a step: a plain
`model(...)` call never sees them. The copies cost the packed weights' memory once more (for k3-scaled about 0.23 GB
in bf16); `DecodeStep(pack_projections=False)` skips them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.backends import check_backend, use_triton
from hybrid_attention.ops.triton_support import triton_available

_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def decode_gemv_enabled(x: torch.Tensor, gemv: str = "auto") -> bool:
    """Whether decode-step products of `x` go to `ops.gemv`: gemv="triton" always (the interpreter on CPU),
    "torch" never (F.linear), "auto" by the rule of `hybrid_attention.backends` (on CUDA, where it beats cuBLAS's
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


def decode_act_mul(module: nn.Module, a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """act(a) * b (SwiGLU's SiLU(gate) * up, Gated MLA's sigmoid(gate) * o): in one Triton kernel (`ops.act_mul`,
    the same rounding as the eager ops) while a decode step has installed its packed weights on `module` and the
    tensors are on CUDA, else the two eager ops."""
    decoding = getattr(module, "packed_projection", None) is not None
    if decoding and _act_mul_ok(a, b):
        from hybrid_attention.ops.act_mul import act_mul  # imports triton

        return act_mul(a, b, act)
    return _ACTS[act](a) * b


def _act_mul_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`ops.act_mul` (no backward) takes a and b: one dtype, and the rule of `hybrid_attention.backends`."""
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


def project(module: nn.Module, x: torch.Tensor, linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """The outputs of `linears` (in this order) on x: from the module's `PackedLinear` if a decode step installed
    one, else one call each."""
    packed = getattr(module, "packed_projection", None)
    if packed is not None:
        return packed(x)
    return tuple(lin(x) for lin in linears)


class PackedProjections:
    """Packed copies of every layer's input projections in `model` (`module.packed_linears()` names them); the
    model's other `nn.Linear`s (output projections, the low-rank up projections, the head) are `singles`. gemv:
    the backend of every product (see `decode_gemv_enabled`)."""

    def __init__(self, model: nn.Module, gemv: str = "auto"):
        check_backend(gemv, "PackedProjections: gemv")
        self.gemv = gemv
        self.by_module = {
            m: PackedLinear(m.packed_linears(), gemv) for m in model.modules() if hasattr(type(m), "packed_linears")
        }
        packed = {id(lin) for m in self.by_module for lin in m.packed_linears()}
        self.singles = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in packed]

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Let the layers use the packed weights inside the block (a model call, or a CUDA-graph capture); unless
        gemv is "torch" the singles go through `decode_linear` too (their own weights, no copies)."""
        singles = self.singles if self.gemv != "torch" else []
        for module, packed in self.by_module.items():
            module.packed_projection = packed
        for lin in singles:  # an instance attribute shadows nn.Linear.forward for this block only
            lin.forward = functools.partial(_single_forward, lin, gemv=self.gemv)
        try:
            yield
        finally:
            for module in self.by_module:
                module.packed_projection = None
            for lin in singles:
                del lin.forward

    def nbytes(self) -> int:
        """Bytes of the packed copies (weights and biases)."""
        return sum(
            t.numel() * t.element_size() for p in self.by_module.values() for t in (p.weight, p.bias) if t is not None
        )


def _single_forward(lin: nn.Linear, x: torch.Tensor, gemv: str) -> torch.Tensor:
    return decode_linear(x, lin.weight, lin.bias, gemv)
