"""SwiGLU feed-forward: down(SiLU(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.layers.packed import project
from hybrid_attention.ops.triton_support import triton_runs_on


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]."""
        gate, up = project(self, x, self.packed_linears())
        if getattr(self, "packed_projection", None) is not None and triton_runs_on(x, cpu_interpreter=False):
            from hybrid_attention.ops.act_mul import act_mul  # imports triton

            # A decode step (it installed the packed weights): one kernel instead of two, the same rounding.
            return self.down_proj(act_mul(gate, up, "silu"))
        return self.down_proj(F.silu(gate) * up)

    def packed_linears(self) -> list[nn.Linear]:
        """The bias-free projections of x, in the order `forward` unpacks them (see layers/packed.py)."""
        return [self.gate_proj, self.up_proj]
