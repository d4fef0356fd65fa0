"""SwiGLU feed-forward: down(SiLU(gate(x)) * up(x)). In training on CUDA the gate and up projections run as one matmul
and the product and down projection as one op; elsewhere the eager code here, the reference, runs (docs/kernels.md,
"SwiGLU in training").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.layers.packed import PackedProjections, act_mul, linear, project, stack_in_training
from hybrid_attention.ops.numerics import compute_dtype


class _SiLUMul(torch.autograd.Function):
    """SiLU(a) * b with the eager ops' forward, keeping only a and b for the backward (autograd on the eager ops
    also keeps SiLU(a), one more [..., intermediate] tensor per MLP); the backward recomputes sigmoid(a):

    da = dy b s (1 + a (1 - s)),   db = dy SiLU(a),   s = sigmoid(a)   (in compute_dtype(a))."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        dtype = compute_dtype(a)
        af, dyf = a.to(dtype), dy.to(dtype)
        s = torch.sigmoid(af)
        da = dyf * b.to(dtype) * s * (1 + af * (1 - s))
        db = dyf * (af * s).to(a.dtype).to(dtype)  # the forward multiplied by SiLU(a) rounded to a's dtype
        return da.to(a.dtype), db.to(b.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, *, decode: PackedProjections | None = None) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]. `decode`: a decode step's packed projections (layers/packed.py)."""
        if decode is None and stack_in_training(x, self.packed_linears()):
            from hybrid_attention.ops.swiglu import swiglu_down  # imports triton

            gate_up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))  # [..., 2 intermediate]
            # The cast nn.Linear makes under autocast, so that the op's two matmuls read one dtype.
            return swiglu_down(gate_up, self.down_proj.weight.to(gate_up.dtype))
        gate, up = project(self, x, decode)
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(_SiLUMul.apply(gate, up))
        return linear(self.down_proj, act_mul(gate, up, "silu", decode), decode)

    def packed_linears(self) -> list[nn.Linear]:
        """The bias-free projections of x, in the order `forward` unpacks them (see layers/packed.py)."""
        return [self.gate_proj, self.up_proj]
