"""SwiGLU feed-forward: down(SiLU(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from hybrid_attention.layers.packed import PackedProjections, act_mul, linear, project


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, *, decode: PackedProjections | None = None) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]. `decode`: a decode step's packed projections (layers/packed.py)."""
        gate, up = project(self, x, decode)
        return linear(self.down_proj, act_mul(gate, up, "silu", decode), decode)

    def packed_linears(self) -> list[nn.Linear]:
        """The bias-free projections of x, in the order `forward` unpacks them (see layers/packed.py)."""
        return [self.gate_proj, self.up_proj]
