"""The fused RMSNorm op (`ops.rms_norm`, Triton interpreter on CPU) against the eager reference `rms_norm`: the output
and both gradients in float64 at odd shapes, float32 / bf16 against the eager roundings, the custom ops through
`opcheck`, a fullgraph compile, and `RMSNorm` taking the op where the rule of `ops.backends` says so."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.numerics import rms_norm
from tests.helpers import DEV, assert_as_accurate, assert_close, needs_triton

pytest.importorskip("triton")
from hybrid_attention.ops.rms_norm import rms_norm_fused  # noqa: E402

pytestmark = needs_triton
F64 = torch.float64


def _grads(fn, x, w, dy):
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(xs, ws)
    y.backward(dy)
    return y.detach(), xs.grad, ws.grad


def _inputs(shape, dtype, seed, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g, dtype=F64) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g, dtype=F64).to(w_dtype or dtype)
    dy = torch.randn(*shape, generator=g, dtype=F64).to(dtype)
    return x.to(DEV), w.to(DEV), dy.to(DEV)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
@pytest.mark.parametrize("shape", [(1, 5), (37, 130), (3, 7, 48), (2, 33)])
def test_float64_matches_reference(shape):
    x, w, dy = _inputs(shape, F64, sum(shape))
    out, dx, dw = _grads(lambda x, w: rms_norm_fused(x, w, 1e-5), x, w, dy)
    ref, rdx, rdw = _grads(lambda x, w: rms_norm(x, w, 1e-5), x, w, dy)
    assert out.dtype == F64 and dx.dtype == F64 and dw.dtype == F64
    assert_close("y", out, ref, 1e-14)
    assert_close("dx", dx, rdx, 1e-12)
    assert_close("dw", dw, rdw, 1e-12)


@pytest.mark.skipif(DEV == "cuda", reason="float64 kernels run under the interpreter only")
def test_float64_strided_rows_and_gradcheck():
    # x a slice of a wider tensor (row stride 70, as a packed projection gives), dy an expanded tensor.
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 9, 70, generator=g, dtype=F64)
    x = wide[..., 10:58]
    w = torch.randn(48, generator=g, dtype=F64)
    dy = torch.randn(48, generator=g, dtype=F64).expand(2, 9, 48)
    out, dx, dw = _grads(lambda x, w: rms_norm_fused(x, w, 1e-6), x, w, dy)
    ref, rdx, rdw = _grads(lambda x, w: rms_norm(x, w, 1e-6), x, w, dy)
    assert_close("y", out, ref, 1e-14)
    assert_close("dx", dx, rdx, 1e-12)
    assert_close("dw", dw, rdw, 1e-12)
    xs, ws = x[:1, :3].detach().clone().requires_grad_(), w.clone().requires_grad_()
    torch.autograd.gradcheck(lambda x, w: rms_norm_fused(x, w, 1e-6), (xs, ws))


# The interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest), so bf16 is checked on CUDA only.
LOW = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_as_accurate_as_eager(dtype):
    # float32 weights, as under autocast; rows not a multiple of the rows per program.
    x, w, dy = _inputs((19, 130), dtype, 7, w_dtype=torch.float32)
    out, dx, dw = _grads(lambda x, w: rms_norm_fused(x, w, 1e-6), x, w, dy)
    plain = _grads(lambda x, w: rms_norm(x, w, 1e-6), x, w, dy)
    exact = _grads(lambda x, w: rms_norm(x, w, 1e-6), x.double(), w.double(), dy.double())
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    for name, ours, ref, base in zip(("y", "dx", "dw"), (out, dx, dw), exact, plain, strict=True):
        assert_as_accurate(name, ours, ref, base)
    if dtype == torch.float32:  # the same operations in the same precision: only the sums' order differs
        assert_close("y", out, plain[0], 1e-6)


def test_output_dtype_is_the_cast_of_the_float32_result():
    # Written straight in float16 (the interpreter rounds to bf16 toward zero, so float16 stands in for it here):
    # the float32 result rounded once, and the same gradients as through a cast.
    x, w, dy = _inputs((13, 130), torch.float32, 19)
    dy16 = dy.half()
    low = _grads(lambda x, w: rms_norm_fused(x, w, 1e-6, torch.float16), x, w, dy16)
    cast = _grads(lambda x, w: rms_norm_fused(x, w, 1e-6).half(), x, w, dy16)
    assert low[0].dtype == torch.float16 and low[1].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(low, cast, strict=True))


def test_module_under_autocast_writes_the_autocast_dtype(monkeypatch):
    import hybrid_attention.layers.norm as norm_mod

    monkeypatch.setattr(norm_mod, "use_triton", lambda x, **kw: True)
    norm = norm_mod.RMSNorm(48).to(DEV)
    x, _, _ = _inputs((3, 48), torch.float32, 23)
    with torch.autocast(DEV, dtype=torch.float16):
        y = norm(x)
        assert y.dtype == torch.float16 and torch.equal(y, rms_norm_fused(x, norm.weight, norm.eps).half())
        assert norm(x.half()).dtype == torch.float16
    assert norm(x).dtype == torch.float32


def test_dw_is_deterministic():
    x, w, dy = _inputs((67, 48), torch.float32, 9)
    first = _grads(lambda x, w: rms_norm_fused(x, w, 1e-6), x, w, dy)
    second = _grads(lambda x, w: rms_norm_fused(x, w, 1e-6), x, w, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_opcheck():
    x, w, dy = _inputs((5, 48), torch.float32, 11)
    ops = torch.ops.hybrid_attention
    torch.library.opcheck(ops.rms_norm_fwd, (x, w, 1e-6, torch.float32))
    torch.library.opcheck(ops.rms_norm_fwd, (x, w, 1e-6, torch.float16))
    rstd = ops.rms_norm_fwd(x, w, 1e-6, torch.float32)[1]
    torch.library.opcheck(ops.rms_norm_bwd, (dy, x.detach(), w.detach(), rstd))


def test_compile_fullgraph():
    x, w, dy = _inputs((6, 48), torch.float32, 13)
    fn = lambda x, w: rms_norm_fused(x, w, 1e-6) * 2  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")
    ref = _grads(fn, x, w, dy)
    got = _grads(compiled, x, w, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        assert_close(name, a, b, 1e-6)


def test_module_takes_the_op_by_the_rule(monkeypatch):
    """`RMSNorm` runs the op where `use_triton` holds (CUDA; here the check is lifted so the interpreter runs it),
    the eager reference otherwise, with the same output and gradients."""
    import hybrid_attention.layers.norm as norm_mod
    import hybrid_attention.ops.rms_norm as op_mod

    calls = []
    real = op_mod.rms_norm_fused
    monkeypatch.setattr(op_mod, "rms_norm_fused", lambda *a: calls.append(1) or real(*a))
    norm = norm_mod.RMSNorm(48, eps=1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.normal_()
    x, _, dy = _inputs((3, 5, 48), torch.float32, 17)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(norm_mod, "use_triton", lambda x, fused=fused, **kw: fused)
        norm.zero_grad()
        results[fused] = _grads(lambda x, w: norm(x), x, norm.weight, dy)[:2] + (norm.weight.grad.clone(),)
    assert calls == [1]
    for name, a, b in zip(("y", "dx", "dw"), results[True], results[False], strict=True):
        assert_close(name, a, b, 1e-6)


def test_bad_input():
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_fused(x, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="needs triton"):
        rms_norm_fused(x.to(torch.int32), torch.ones(8, device=DEV), 1e-6)
