"""Helpers shared by the tests: the device and markers, tolerances (relative error ||a - b|| / ||b||, NaN never
passes) and the CLI run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.bench_common import checkout_env as checkout_env  # the tests' child processes too
from hybrid_attention.ops.triton_support import triton_runs_on

REPO_ROOT = Path(__file__).resolve().parents[1]


# Where the tests that run on either device put their tensors: the GPU when there is one, else the CPU (with the
# Triton kernels under the interpreter, which conftest.py turns on before triton is imported).
DEV = "cuda" if torch.cuda.is_available() else "cpu"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(
    not triton_runs_on(torch.empty(1, device=DEV)), reason="needs triton and CUDA or TRITON_INTERPRET=1"
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `out` against `ref`, computed in float64. Returns inf if either holds NaN/inf."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not (torch.isfinite(out64).all() and torch.isfinite(ref64).all()):
        return float("inf")
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    if denom == 0.0:
        return diff
    return diff / denom


# The modules a forked training job imports, for multiprocessing's forkserver to import once before it forks any
# (tests/training/test_distributed.py, tests/runs/test_crash.py). A process has one forkserver, started by the first
# test that forks: its list is the one every later test's children inherit, so those tests name this same one.
# torch._dynamo: the first optimizer's construction imports it, over a second in each child otherwise; matplotlib:
# the loss plot; tqdm: the progress bar.
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "matplotlib.pyplot", "tqdm", "hybrid_attention.training.loop",
                      "hybrid_attention.cli", "hybrid_attention.training.distributed")  # fmt: skip


# FLA's tests pass a half-precision comparison whose largest absolute error is at most 1e-6 whatever its relative
# error: a quantity that lives below float16's normal range (6.1e-5, e.g. a gradient scaled by exp(-12)) is stored
# to 2^-24 absolute, so its relative error measures that range rather than the kernel.
HALF_ABS_FLOOR = 1e-6


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference of `out` from `ref`, in float64; inf if `out` holds NaN or inf."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return (out64 - ref64).abs().max().item() if out64.numel() else 0.0


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Assert that `out` matches `ref` in shape and to relative error `tol`."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.1e}"


def assert_as_accurate(
    name: str, out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, factor=2.0, floor=1e-7
) -> None:
    """`out` is within `factor` of the error of `baseline` (the same function by the plain path, at the same
    precision) against a more precise `ref`, or within `floor` of it (the precision's own rounding, so that a plain
    path that is lucky on a few numbers does not fail an accurate one). For comparing two low-precision paths where
    a fixed tolerance would measure the conditioning of the quantity rather than the path; a wrong path is off by
    far more (order 1)."""
    err, base = rel_err(out.cpu(), ref.cpu()), rel_err(baseline.cpu(), ref.cpu())
    print(f"{name}: rel. error vs reference {err:.2e}, plain path {base:.2e}")
    bound = max(factor * base, floor)
    assert err <= bound, f"{name}: error {err:.2e} vs the reference > max({factor} x the plain {base:.2e}, {floor:.1e})"


def round_bfloat16_like_the_gpu(monkeypatch) -> None:
    """Make the Triton interpreter round float32 -> bfloat16 to nearest even, as the GPU does (it truncates, which
    doubles the rounding error and biases it), so that bf16 accuracy can be checked on the CPU. A no-op on a GPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:  # a Triton whose interpreter converts elsewhere: the check would not mean what it says
        import pytest

        pytest.skip("this Triton interpreter has no _convert_float to patch")

    def convert(values, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(values).view(np.float32).copy())
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(values, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised-looking tensor filled with NaN, so an unwritten element fails a comparison."""
    return torch.full_like(t, float("nan"))


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of `hybrid-attention *argv` run in this process (`capsys`: pytest's fixture)."""
    from hybrid_attention import cli

    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
