"""Muon with its matrices orthogonalised in stacks, `StackedMuon`: `torch.optim.Muon`'s update and state with a few
launches per matrix shape, capturable in a CUDA graph (docs/training.md, "Muon").
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from hybrid_attention.ops.numerics import HALF_DTYPES, compute_dtype

# The most elements stacked at once: 64M. A slice's temporaries (float32 blend, stack and update, bfloat16 iterates)
# then stay at about 1 GB at most, whatever the model's size.
STACK_ELEMENTS = 1 << 26


def newton_schulz(updates: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """The quintic Newton-Schulz orthogonalisation of each matrix of a stack, in bfloat16, as `torch.optim.Muon`
    does it for one matrix (wide matrices iterate X X^T, tall ones their transpose).

    updates: [n, rows, cols] -> [n, rows, cols] bfloat16, each matrix near U V^T of its SVD U S V^T.
    """
    a, b, c = coefficients
    x = updates.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


class StackedMuon(torch.optim.Muon):
    """`torch.optim.Muon` (the same arguments, parameter groups and state) with the stacked step of the module
    docstring; `group["lr"]` may be a float or a one-element tensor on the parameters' device."""

    device_lr = True  # takes the learning rate as a device tensor: a CUDA graph can capture the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or p.grad.is_complex():
                    raise ValueError(f"StackedMuon: expected a dense real gradient, got {p.grad.layout} {p.grad.dtype}")
                by_shape[p.shape, p.dtype, p.device].append(p)
            for (shape, _, _), params in by_shape.items():
                per_slice = max(1, STACK_ELEMENTS // max(1, shape.numel()))
                for start in range(0, len(params), per_slice):
                    self._update(params[start : start + per_slice], group)
        return loss

    def _momentum_buffers(self, params: list[Tensor]) -> list[Tensor]:
        """Each matrix's momentum, made (zeros) at its first step."""
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return [self.state[p]["momentum_buffer"] for p in params]

    def _update(self, params: list[Tensor], group: dict) -> None:
        """One slice of matrices of one shape: momentum, orthogonalised update, decay, step."""
        grads, bufs = [p.grad for p in params], self._momentum_buffers(params)
        momentum, lr = group["momentum"], group["lr"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        blended = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        ortho = newton_schulz(torch.stack(blended), group["ns_coefficients"], group["ns_steps"], group["eps"])
        apply = self._apply_device_rate if isinstance(lr, Tensor) else self._apply_float_rate
        apply(params, ortho, lr, group)

    @staticmethod
    def _apply_float_rate(params: list[Tensor], ortho: Tensor, lr: float, group: dict) -> None:
        """The decay and the update with a float rate, as `torch.optim.Muon` applies them."""
        decay = 1 - lr * group["weight_decay"]
        if params[0].dtype in HALF_DTYPES:
            for p in params:  # a foreach product rounds a number to the half dtype first; torch's mul_ does not
                p.mul_(decay)
        else:
            torch._foreach_mul_(params, decay)
        # The update in the dtype torch's mixed add computes in, contiguous like the parameters (a tall shape's
        # iterate is a transposed view): matching layouts keep the foreach add one fused kernel on CUDA.
        dtype = torch.promote_types(params[0].dtype, ortho.dtype)
        ortho = ortho.to(dtype, memory_format=torch.contiguous_format)
        step = _adjust_lr(lr, group["adjust_lr_fn"], params[0].shape)
        torch._foreach_add_(params, list(ortho.unbind(0)), alpha=-step)

    @staticmethod
    def _apply_device_rate(params: list[Tensor], ortho: Tensor, lr: Tensor, group: dict) -> None:
        """`_apply_float_rate` with a one-element device rate, rounded as the float rate's step is wherever float32
        holds that rate exactly (and within its float32 rounding otherwise), with no host read.

        The float path computes the decay and the scaled rate in float64 on the host, and its kernels take them as
        numbers in the computing type (float32, float64 for float64 parameters), never the half dtype. So:
        - the decay and the scaled rate are computed in float64 here too, then cast to that computing type;
        - half parameters are decayed in float32 (a device number is cast to the parameters' dtype otherwise, and a
          decay of 1 - 1e-4 would round to 1);
        - the update is one fused multiply-add, `addcmul`, as the float path's `add(alpha=)` is (a product and then
          an add would round twice).
        """
        compute = compute_dtype(params[0])
        rate = lr.to(torch.float64)
        decay = (1 - rate * group["weight_decay"]).to(compute)
        if params[0].dtype in HALF_DTYPES:
            for p in params:
                p.copy_(p.float().mul_(decay))
        else:
            torch._foreach_mul_(params, decay)
        step = -_adjust_lr(rate, group["adjust_lr_fn"], params[0].shape).to(compute)
        ortho = ortho.to(compute, memory_format=torch.contiguous_format)
        torch._foreach_addcmul_(params, list(ortho.unbind(0)), [step] * len(params))


class GatheredMuon(StackedMuon):
    """Muon for FSDP2-sharded matrices: the momentum stays sharded, each update is gathered whole.

    torch's Muon has no DTensor path of its own (on a sharded DTensor its Newton-Schulz matmuls would redistribute
    on every iteration). Here the momentum and Nesterov blend run on the local shards, the update is all-gathered
    once per parameter, orthogonalised by torch's own Newton-Schulz on every rank, and each rank keeps its slice. The
    arithmetic is torch.optim.Muon's (the same functions), one matrix at a time; the learning rate is read as a
    number, so this step is never captured in a CUDA graph (a sharded step is not: `train_step`).
    """

    device_lr = False

    def _update(self, params: list[Tensor], group: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        lr = float(group["lr"])
        for p, buf in zip(params, self._momentum_buffers(params), strict=True):
            buf.lerp_(p.grad, 1 - group["momentum"])
            update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            whole = update.full_tensor() if isinstance(update, DTensor) else update
            ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
            if isinstance(p, DTensor):
                ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
