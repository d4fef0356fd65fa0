"""The fused RMSNorm and SwiGLU training ops on CUDA at real sizes (16K rows x 1024 and x 2816), and a training step
with the fast paths against `use_reference()` (skips without CUDA).

Run on a GPU machine: python -m pytest -q tests/gpu/ops/test_lean_ops_gpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.backends import use_reference
from hybrid_attention.ops.numerics import rms_norm
from hybrid_attention.ops.rms_norm import rms_norm_fused
from hybrid_attention.ops.swiglu import swiglu_down
from tests.helpers import assert_as_accurate, assert_close, needs_cuda

pytestmark = needs_cuda
ROWS = 16 * 1024


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


def _check(names, ours, exact, plain):
    for name, a, e, p in zip(names, ours, exact, plain, strict=True):
        assert a.dtype == p.dtype, (name, a.dtype, p.dtype)
        assert_as_accurate(name, a, e, p)


def test_rms_norm_real_size():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = 1 + 0.1 * torch.randn(1024, device="cuda", generator=g)
    for dtype in (torch.float32, torch.bfloat16):  # the residual stream's float32, and a bf16 model's
        x = (3 * torch.randn(ROWS + 5, 1024, device="cuda", generator=g)).to(dtype)
        dy = torch.randn(ROWS + 5, 1024, device="cuda", generator=g).to(dtype)
        fused = lambda x, w: rms_norm_fused(x, w, 1e-6)  # noqa: E731
        eager = lambda x, w: rms_norm(x, w, 1e-6)  # noqa: E731
        ours = _grads(fused, (x, w), dy)
        exact = _grads(eager, (x.double(), w.double()), dy.double())
        _check(("y", "dx", "dw"), ours, exact, _grads(eager, (x, w), dy))
        again = _grads(fused, (x, w), dy)
        assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True)), "not deterministic"


def test_swiglu_real_size():
    g = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = (2 * torch.randn(ROWS + 3, 2 * 2816, device="cuda", generator=g)).to(dtype)
        weight = (torch.randn(1024, 2816, device="cuda", generator=g) / 2816**0.5).to(dtype)
        dout = torch.randn(ROWS + 3, 1024, device="cuda", generator=g).to(dtype)

        def eager(gu, w):
            a, b = gu.chunk(2, dim=-1)
            return F.linear(F.silu(a) * b, w)

        ours = _grads(swiglu_down, (gate_up, weight), dout)
        exact = _grads(eager, (gate_up.double(), weight.double()), dout.double())
        _check(("out", "d gate_up", "d weight"), ours, exact, _grads(eager, (gate_up, weight), dout))


def test_training_step_matches_reference():
    """A standard-residual model (both mixers) in float32: loss and every gradient with the fast paths (fused norms,
    the stacked SwiGLU matmul, the short conv and gated norm kernels) equal the PyTorch references' to float32
    accuracy. The KDA chunk op runs its reference both times (its kernels use TF32 products, tested elsewhere)."""
    torch.manual_seed(0)
    config = HybridConfig.from_preset("tiny", residual="standard", hidden_size=256, intermediate_size=704)
    model = HybridLM(config, kda_backend="torch").cuda()
    ids = torch.randint(0, config.vocab_size, (2, 300), device="cuda")
    results = {}
    for reference in (False, True):
        model.zero_grad(set_to_none=True)
        with use_reference(reference):
            loss = model(ids, labels=ids, return_logits=False).loss
            loss.backward()
        results[reference] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert_close("loss", results[False][0], results[True][0], 1e-5)
    for name, grad in results[True][1].items():
        assert_close(f"d {name}", results[False][1][name], grad, 1e-4)
