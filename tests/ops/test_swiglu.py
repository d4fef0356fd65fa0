"""The fused SwiGLU product and down projection (`ops.swiglu`, Triton interpreter on CPU) against the eager
`F.linear(F.silu(a) * b, W)`: output and gradients in float64 at odd shapes, float32 / float16 against the eager
roundings, the custom ops through `opcheck`, a fullgraph compile, a frozen down weight, and `SwiGLU` taking the
stacked matmul and the op where the rule of `hybrid_attention.ops.backends` says so, keeping only the op's inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEV, assert_as_accurate, assert_close, needs_triton

pytest.importorskip("triton")
from hybrid_attention.ops.swiglu import swiglu_down  # noqa: E402

pytestmark = needs_triton
F64 = torch.float64


NAMES = ("out", "d gate_up", "d weight")


def _eager(gate_up, weight):
    a, b = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(a) * b, weight)


def _grads(fn, gate_up, weight, dout):
    """(out, d gate_up, d weight) of fn(gate_up, weight) against dout."""
    gu, w = (t.detach().clone().requires_grad_() for t in (gate_up, weight))
    out = fn(gu, w)
    out.backward(dout)
    return out.detach(), gu.grad, w.grad


def _inputs(rows, width, out_width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(*rows, 2 * width, generator=g, dtype=F64) * 3).to(dtype).to(DEV)
    weight = (torch.randn(out_width, width, generator=g, dtype=F64) * width**-0.5).to(dtype).to(DEV)
    dout = torch.randn(*rows, out_width, generator=g, dtype=F64).to(dtype).to(DEV)
    return gate_up, weight, dout


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
@pytest.mark.parametrize("rows, width, out_width", [((1,), 5, 3), ((37,), 130, 17), ((3, 7), 48, 64), ((2,), 1100, 9)])
def test_float64_matches_reference(rows, width, out_width):
    inputs = _inputs(rows, width, out_width, F64, width)
    ours = _grads(swiglu_down, *inputs)
    for name, a, b in zip(NAMES, ours, _grads(_eager, *inputs), strict=True):
        assert a.dtype == F64, name
        assert_close(name, a, b, 1e-13)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_float64_strided_rows_and_gradcheck():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 9, 110, generator=g, dtype=F64)
    gate_up = wide[..., 7:103]  # a row stride of 110, as a slice of a wider projection gives
    weight = torch.randn(5, 48, generator=g, dtype=F64)
    dout = torch.randn(5, generator=g, dtype=F64).expand(2, 9, 5)  # an expanded gradient: not contiguous
    for name, a, b in zip(NAMES, _grads(swiglu_down, gate_up, weight, dout), _grads(_eager, gate_up, weight, dout),
                          strict=True):  # fmt: skip
        assert_close(name, a, b, 1e-13)
    small = (gate_up[:2, :1, [0, 1, 48, 49]].detach().clone().requires_grad_(), weight[:3, :2].clone().requires_grad_())
    torch.autograd.gradcheck(swiglu_down, small)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_frozen_weight_gives_only_the_input_gradient():
    gate_up, weight, dout = _inputs((7,), 20, 6, F64, 5)
    gu = gate_up.clone().requires_grad_()
    swiglu_down(gu, weight).backward(dout)
    assert weight.grad is None
    assert_close("d gate_up", gu.grad, _grads(_eager, gate_up, weight, dout)[1], 1e-13)


# The interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest), so bf16 is checked on CUDA only.
LOW = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_as_accurate_as_eager(dtype):
    inputs = _inputs((19,), 130, 24, dtype, 7)
    ours = _grads(swiglu_down, *inputs)
    plain = _grads(_eager, *inputs)
    exact = _grads(_eager, *(t.double() for t in inputs))
    for name, a, p, e in zip(NAMES, ours, plain, exact, strict=True):
        assert a.dtype == dtype, name
        assert_as_accurate(name, a, e, p)
    # The same matmuls on the same rounded product: the eager results up to the kernels' float32 rounding.
    assert_close("out vs eager", ours[0], plain[0], 1e-6 if dtype == torch.float32 else 1e-3)


def test_opcheck():
    gate_up, weight, dout = _inputs((5,), 48, 16, torch.float32, 11)
    ops = torch.ops.hybrid_attention
    torch.library.opcheck(ops.swiglu_down_fwd, (gate_up, weight))
    for need_weight_grad in (True, False):
        torch.library.opcheck(ops.swiglu_down_bwd, (dout, gate_up.detach(), weight.detach(), need_weight_grad))


def test_compile_fullgraph():
    inputs = _inputs((6,), 48, 16, torch.float32, 13)
    fn = lambda gu, w: swiglu_down(gu * 2, w)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")
    for name, a, b in zip(NAMES, _grads(compiled, *inputs), _grads(fn, *inputs), strict=True):
        assert_close(name, a, b, 1e-6)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_module_takes_the_op_in_training(monkeypatch):
    """`SwiGLU` runs the stacked matmul and the op when training where `use_triton` holds (CUDA; here the check is
    lifted so the interpreter runs it), with the eager module's output and gradients, keeping for the backward
    nothing but x, the stacked weights, gate_up and the down weight; without gradients it keeps the eager path."""
    import hybrid_attention.layers.mlp as mlp_mod
    import hybrid_attention.layers.packed as packed_mod
    import hybrid_attention.ops.swiglu as op_mod

    calls = []
    real = op_mod.swiglu_down
    monkeypatch.setattr(op_mod, "swiglu_down", lambda gu, w: calls.append(gu.shape) or real(gu, w))
    torch.manual_seed(0)
    mlp = mlp_mod.SwiGLU(12, 21).double()
    x = torch.randn(2, 5, 12, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 5, 12, dtype=F64)
    results, saved = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(packed_mod, "use_triton", lambda x, fused=fused, **kw: fused)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, shapes=shapes: shapes.append(tuple(t.shape)) or t,
                                                      lambda t: t):  # fmt: skip
            y = mlp(x)
        saved[fused] = sorted(shapes)
        results[fused] = (y, *torch.autograd.grad(y, [x, *mlp.parameters()], dy))
    assert calls == [(2, 5, 42)]
    # The fused path keeps x, the stacked weights, gate_up and the down weight (in whatever views the matmuls save);
    # the eager one keeps gate, up and the product SiLU(a) * b, [10, 21] each.
    sizes = {fused: [math.prod(shape) for shape in shapes] for fused, shapes in saved.items()}
    assert sorted(sizes[True]) == sorted([10 * 12, 42 * 12, 10 * 42, 12 * 21]), saved[True]
    assert sizes[False].count(10 * 21) == 3, saved[False]
    names = ["y", "x", *(n for n, _ in mlp.named_parameters())]
    for name, a, b in zip(names, results[True], results[False], strict=True):
        assert_close(name, a, b, 1e-13)
    with torch.no_grad():
        mlp(x)
    assert len(calls) == 1


def test_bad_input():
    weight = torch.randn(3, 4, device=DEV)
    with pytest.raises(ValueError, match=r"\[..., 2F\]"):
        swiglu_down(torch.randn(4, 7, device=DEV), weight)
    with pytest.raises(ValueError, match=r"weight must be \[O, 4\] of torch.float32"):
        swiglu_down(torch.randn(4, 8, device=DEV), weight.T)
    with pytest.raises(ValueError, match=r"weight must be \[O, 4\] of torch.float32"):
        swiglu_down(torch.randn(4, 8, device=DEV), weight.half())
    with pytest.raises(ValueError, match=r"weight must be \[O, 4\]"):
        swiglu_down(torch.randn(4, 8, device=DEV), torch.randn(4, device=DEV))
