"""StackedMuon on a GPU at the k3-scaled matrices, against torch.optim.Muon and a float64 computation of the same
update (skips without CUDA).

Run on a GPU machine: python -m pytest -q tests/gpu/training/test_muon_gpu.py

On a GPU the stacked products may round differently from the single ones (the library picks other kernels for a
batch), so the check is the house rule for a low-precision kernel: StackedMuon's update is at most twice as far from
the float64 update as torch's own bfloat16 update is.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _adjust_lr

from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.training.muon import StackedMuon
from hybrid_attention.training.optim import param_groups
from tests.helpers import needs_cuda

pytestmark = needs_cuda


def _newton_schulz_float64(update: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's iteration for one matrix, every operation in float64."""
    a, b, c = coefficients
    x = update.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_step_at_model_shapes_is_as_accurate_as_torch_muon():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("k3-scaled"))
    _, matrices = param_groups(model, 0.1, muon=True)
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in matrices]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    options = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    stacked, single = StackedMuon(ours, **options), torch.optim.Muon(ref, **options)
    grads = [torch.randn_like(p) * 1e-3 for p in ours]
    for p, q, g in zip(ours, ref, grads, strict=True):
        p.grad, q.grad = g, g.clone()
    start = [p.detach().clone() for p in ours]
    stacked.step()
    single.step()
    group = stacked.param_groups[0]
    squares = {}  # shape -> squared distances to the float64 update (ours, torch's) and its squared size
    for p0, p, q, g in zip(start, ours, ref, grads, strict=True):
        # The first step's momentum buffer is (1 - momentum) g; the Nesterov blend lerps g toward it.
        blend = g.double().lerp(g.double() * (1 - group["momentum"]), group["momentum"])
        ortho = _newton_schulz_float64(blend, group["ns_coefficients"], group["ns_steps"], group["eps"])
        exact = p0.double() * (1 - 0.02 * 0.1) - _adjust_lr(0.02, group["adjust_lr_fn"], p.shape) * ortho
        sums = squares.setdefault(tuple(p.shape), [0.0, 0.0, 0.0])
        sums[0] += float((p.detach().double() - exact).square().sum())
        sums[1] += float((q.detach().double() - exact).square().sum())
        sums[2] += float((exact - p0.double()).square().sum())
    # Per shape (every matrix of a stack together, so that a few small matrices do not decide): relative errors.
    errors = {shape: ((o / m) ** 0.5, (t / m) ** 0.5) for shape, (o, t, m) in squares.items()}
    print(errors)
    assert all(ours_err <= 2 * torch_err for ours_err, torch_err in errors.values()), errors
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(stacked.state[p]["momentum_buffer"], single.state[q]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_device_rate_steps_bitwise_as_the_float_rate(dtype):
    """What a CUDA graph replays: a one-element device rate takes the float rate's step bitwise (a rate float32 holds
    exactly, a changing schedule, decay, tall, wide and square matrices), so a graphed Muon run trains as an eager
    one. Half parameters included: their decay must not be rounded to the half dtype."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(512, 256), (256, 512), (256, 256), (8, 256), (768, 256)] * 2
    start = [(torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype) for s in shapes]
    floats, tensors = [[torch.nn.Parameter(p.clone()) for p in start] for _ in range(2)]
    options = dict(weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    by_float, by_tensor = StackedMuon(floats, lr=2.0**-6, **options), StackedMuon(tensors, lr=2.0**-6, **options)
    rate = torch.tensor(2.0**-6, device="cuda")
    by_tensor.param_groups[0]["lr"] = rate
    for lr in (2.0**-6, 2.0**-7, 3 * 2.0**-9, 2.0**-6):
        by_float.param_groups[0]["lr"] = lr
        rate.fill_(lr)
        for p, q in zip(floats, tensors, strict=True):
            p.grad = (torch.randn(p.shape, device="cuda", generator=gen) * 1e-3).to(dtype)
            q.grad = p.grad.clone()
        by_float.step()
        by_tensor.step()
        for p, q in zip(floats, tensors, strict=True):
            assert torch.equal(p, q), (lr, p.shape, (p - q).abs().max())
    assert all(not torch.equal(p, p0) for p, p0 in zip(floats, start, strict=True))
