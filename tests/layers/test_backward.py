"""The layers' hand-written backwards (RMSNorm, SwiGLU's SiLU(a) * b) against autograd on the eager ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.layers.mlp import SwiGLU
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.ops.numerics import rms_norm
from tests.helpers import assert_as_accurate, assert_close


def _grads(fn, *tensors):
    """fn(*tensors) and the gradients of <fn(...), a fixed ramp> with respect to each tensor."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), [t.grad for t in leaves]


def _norm_with(w: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(w.shape[0], eps=eps).to(w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm


@pytest.mark.parametrize("shape", [(1, 1, 5), (3, 7, 16), (2, 33)])
def test_rms_norm_backward_float64(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    norm = _norm_with(w, 1e-5)
    xs = x.clone().requires_grad_()
    out = norm(xs)
    out.backward(torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out))
    ref, (rdx, rdw) = _grads(lambda x, w: rms_norm(x, w, 1e-5), x, w)
    assert torch.equal(out.detach(), ref)  # the same forward ops
    assert_close("dx", xs.grad, rdx, 1e-12)
    assert_close("dw", norm.weight.grad, rdw, 1e-12)
    torch.autograd.gradcheck(norm, (x.clone().requires_grad_(),))


def test_rms_norm_bf16_input_as_accurate_as_eager():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, 64, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(64, generator=g)).requires_grad_()
    exact = _grads(lambda x, w: rms_norm(x, w, 1e-6), x.double(), w.double())
    plain = _grads(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    norm = _norm_with(w.detach(), 1e-6)
    xs = x.clone().requires_grad_()
    out = norm(xs)
    assert out.dtype == torch.bfloat16 and torch.equal(out, plain[0])
    out.backward(torch.linspace(-1, 2, out.numel()).view_as(out).bfloat16())
    assert xs.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32
    assert_as_accurate("dx", xs.grad, exact[1][0], plain[1][0])
    assert_as_accurate("dw", norm.weight.grad, exact[1][1], plain[1][1])


def test_swiglu_backward_float64():
    torch.manual_seed(0)
    mlp = SwiGLU(12, 20).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    eager = lambda x: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    y = mlp(x)
    assert_close("forward", y, eager(x), 1e-15)
    dy = torch.randn_like(y)
    ours = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    ref = torch.autograd.grad(eager(x), [x, *mlp.parameters()], dy)
    for name, a, b in zip(["x", *(n for n, _ in mlp.named_parameters())], ours, ref, strict=True):
        assert_close(name, a, b, 1e-12)
    torch.autograd.gradcheck(mlp, (x,))


def test_swiglu_bf16_as_accurate_as_eager():
    torch.manual_seed(1)
    mlp = SwiGLU(32, 48)
    x = torch.randn(3, 7, 32)
    eager = lambda m, x: m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
    grads = {}
    for name, fn, dtype, autocast in (
        ("exact", eager, torch.float64, False),
        ("plain", eager, torch.float32, True),
        ("ours", lambda m, x: m(x), torch.float32, True),
    ):
        m = SwiGLU(32, 48).to(dtype)
        m.load_state_dict(mlp.state_dict())
        xs = x.to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(m, xs)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        grads[name] = [xs.grad, *(p.grad for p in m.parameters())]
    for i, label in enumerate(["x", "gate", "up", "down"]):
        assert_as_accurate(label, grads["ours"][i], grads["exact"][i], grads["plain"][i])
