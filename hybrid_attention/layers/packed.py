"""Decode-time packing of the projections that read the same input: one matrix-vector product instead of several.

At batch 1 a decode step is mostly small GEMVs, each far below the memory bandwidth: on an H200 a k3-scaled step
spends 0.75 of its 1.24 ms in 149 of them (benchmarks/RESULTS.md, "the decode step, kernel by kernel"). The
projections of one layer that read the same x (KDA: q, k, v, beta, and the decay and output-gate down projections;
Gated MLA: q, the latent down projection, the shared key and the gate; SwiGLU: gate and up) can be read as one
concatenated weight [sum of outputs, in] in one launch, with the same products.

The parameters stay separate (the optimizer, Muon's per-matrix updates and checkpoints see them as they are). A
`PackedProjections` holds concatenated copies, made once by `graphs.DecodeStep` (whose contract already is that the
weights do not change while it is used), and installs them on the layers only for the duration of a step: a plain
`model(...)` call never sees them. The copies cost the packed weights' memory once more (for k3-scaled about 0.23 GB
in bf16); `DecodeStep(pack_projections=False)` skips them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear:
    """Bias-free `nn.Linear`s that read the same input, as one weight: x [..., in] -> their outputs, in order."""

    def __init__(self, linears: Sequence[nn.Linear]):
        if not linears or any(lin.bias is not None for lin in linears):
            raise ValueError("PackedLinear: needs at least one nn.Linear, none with a bias")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(f"PackedLinear: input widths differ: {[lin.in_features for lin in linears]}")
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        self.sizes = [lin.out_features for lin in linears]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split(self.sizes, dim=-1)


def project(module: nn.Module, x: torch.Tensor, linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """The outputs of `linears` (bias-free, in this order) on x: from the module's installed `PackedLinear` if a
    decode step installed one, else one call each."""
    packed = getattr(module, "packed_projection", None)
    if packed is not None:
        return packed(x)
    return tuple(lin(x) for lin in linears)


class PackedProjections:
    """Packed copies of every layer's input projections in `model` (`module.packed_linears()` names them)."""

    def __init__(self, model: nn.Module):
        self.by_module = {
            m: PackedLinear(m.packed_linears()) for m in model.modules() if hasattr(type(m), "packed_linears")
        }

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Let the layers use the packed weights inside the block (a model call, or a CUDA-graph capture)."""
        for module, packed in self.by_module.items():
            module.packed_projection = packed
        try:
            yield
        finally:
            for module in self.by_module:
                module.packed_projection = None

    def nbytes(self) -> int:
        return sum(p.weight.numel() * p.weight.element_size() for p in self.by_module.values())
