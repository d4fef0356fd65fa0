"""The fused SwiGLU product (`ops.swiglu`, Triton interpreter on CPU) against the eager `F.silu(a) * b`: output and
gradient in float64 at odd shapes, float32 / float16 against the eager roundings, the custom ops through `opcheck`, a
fullgraph compile, and `SwiGLU` taking the stacked matmul and the op where the rule of `hybrid_attention.backends`
says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import DEV, needs_triton
from tests.helpers import assert_as_accurate, assert_close

pytest.importorskip("triton")
from hybrid_attention.ops.swiglu import swiglu_fused  # noqa: E402

pytestmark = needs_triton
F64 = torch.float64


def _eager(gate_up):
    a, b = gate_up.chunk(2, dim=-1)
    return F.silu(a) * b


def _grads(fn, gate_up, dy):
    gu = gate_up.detach().clone().requires_grad_()
    y = fn(gu)
    y.backward(dy)
    return y.detach(), gu.grad


def _inputs(rows, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(*rows, 2 * width, generator=g, dtype=F64) * 3).to(dtype).to(DEV)
    dy = torch.randn(*rows, width, generator=g, dtype=F64).to(dtype).to(DEV)
    return gate_up, dy


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
@pytest.mark.parametrize("rows, width", [((1,), 5), ((37,), 130), ((3, 7), 48), ((2,), 1100)])
def test_float64_matches_reference(rows, width):
    gate_up, dy = _inputs(rows, width, F64, width)
    out, dgu = _grads(swiglu_fused, gate_up, dy)
    ref, rdgu = _grads(_eager, gate_up, dy)
    assert out.dtype == F64 and dgu.dtype == F64
    assert_close("y", out, ref, 1e-14)
    assert_close("d gate_up", dgu, rdgu, 1e-13)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_float64_strided_rows_and_gradcheck():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 9, 110, generator=g, dtype=F64)
    gate_up = wide[..., 7:103]  # a row stride of 110, as a slice of a wider projection gives
    dy = torch.randn(48, generator=g, dtype=F64).expand(2, 9, 48)
    out, dgu = _grads(swiglu_fused, gate_up, dy)
    ref, rdgu = _grads(_eager, gate_up, dy)
    assert_close("y", out, ref, 1e-14)
    assert_close("d gate_up", dgu, rdgu, 1e-13)
    torch.autograd.gradcheck(swiglu_fused, (gate_up[:1, :2].detach().clone().requires_grad_(),))


# The interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest), so bf16 is checked on CUDA only.
LOW = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_as_accurate_as_eager(dtype):
    gate_up, dy = _inputs((19,), 130, dtype, 7)
    out, dgu = _grads(swiglu_fused, gate_up, dy)
    plain = _grads(_eager, gate_up, dy)
    exact = _grads(_eager, gate_up.double(), dy.double())
    assert out.dtype == dtype and dgu.dtype == dtype
    assert_as_accurate("y", out, exact[0], plain[0])
    assert_as_accurate("d gate_up", dgu, exact[1], plain[1])
    assert_close("y vs eager", out, plain[0], 1e-6 if dtype == torch.float32 else 1e-3)


def test_opcheck():
    gate_up, dy = _inputs((5,), 48, torch.float32, 11)
    ops = torch.ops.hybrid_attention
    torch.library.opcheck(ops.swiglu_fwd, (gate_up.requires_grad_(),))
    torch.library.opcheck(ops.swiglu_bwd, (dy, gate_up.detach()))


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_custom_op_autograd_matches_the_eager_function():
    # Compiled graphs run the custom ops (their registered backward), eager calls the autograd Function.
    gate_up, dy = _inputs((9,), 48, F64, 29)
    ops = _grads(torch.ops.hybrid_attention.swiglu_fwd, gate_up, dy)
    for name, a, b in zip(("y", "d gate_up"), ops, _grads(swiglu_fused, gate_up, dy), strict=True):
        assert torch.equal(a, b), name


def test_compile_fullgraph():
    gate_up, dy = _inputs((6,), 48, torch.float32, 13)
    fn = lambda gu: swiglu_fused(gu * 2)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")
    for name, a, b in zip(("y", "d gate_up"), _grads(compiled, gate_up, dy), _grads(fn, gate_up, dy), strict=True):
        assert_close(name, a, b, 1e-6)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_module_takes_the_op_in_training(monkeypatch):
    """`SwiGLU` runs the stacked matmul and the op when training where `use_triton` holds (CUDA; here the check is
    lifted so the interpreter runs it), with the eager module's output and gradients; without gradients it keeps
    the eager path."""
    import hybrid_attention.layers.mlp as mlp_mod
    import hybrid_attention.layers.packed as packed_mod
    import hybrid_attention.ops.swiglu as op_mod

    calls = []
    real = op_mod.swiglu_fused
    monkeypatch.setattr(op_mod, "swiglu_fused", lambda gu: calls.append(gu.shape) or real(gu))
    torch.manual_seed(0)
    mlp = mlp_mod.SwiGLU(12, 21).double()
    x = torch.randn(2, 5, 12, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 5, 12, dtype=F64)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(packed_mod, "use_triton", lambda x, fused=fused, **kw: fused)
        y = mlp(x)
        results[fused] = (y, *torch.autograd.grad(y, [x, *mlp.parameters()], dy))
    assert calls == [(2, 5, 42)]
    names = ["y", "x", *(n for n, _ in mlp.named_parameters())]
    for name, a, b in zip(names, results[True], results[False], strict=True):
        assert_close(name, a, b, 1e-13)
    with torch.no_grad():
        mlp(x)
    assert len(calls) == 1


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[..., 2F\]"):
        swiglu_fused(torch.randn(4, 7, device=DEV))
