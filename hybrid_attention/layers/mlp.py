"""SwiGLU feed-forward: down(SiLU(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from hybrid_attention.layers.packed import decode_act_mul, project


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]."""
        gate, up = project(self, x, self.packed_linears())
        return self.down_proj(decode_act_mul(self, gate, up, "silu"))

    def packed_linears(self) -> list[nn.Linear]:
        """The bias-free projections of x, in the order `forward` unpacks them (see layers/packed.py)."""
        return [self.gate_proj, self.up_proj]
