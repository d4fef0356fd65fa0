"""Can a Triton kernel run here? One answer for every op's dispatcher and every layer's fused path.

Triton kernels launch on CUDA tensors, or on CPU tensors when Triton's interpreter is on (TRITON_INTERPRET=1, set by
tests/conftest.py on machines without a GPU). Every kernel here takes float16, bfloat16 or float32 inputs.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Looked up once at import: a plain constant also keeps torch.compile from tracing through a cache wrapper.
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """The triton package is importable (the PyTorch paths work without it)."""
    return _TRITON_AVAILABLE


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_runs_on(x: torch.Tensor, *, cpu_interpreter: bool = True) -> bool:
    """A Triton kernel can take `x`: a supported dtype, triton installed, and a CUDA tensor (or, when
    `cpu_interpreter`, a CPU tensor under the interpreter)."""
    if not triton_available() or x.dtype not in TRITON_DTYPES:
        return False
    return x.is_cuda or (cpu_interpreter and x.device.type == "cpu" and interpreting())


def eager_or_traced(op, body):
    """The entry to the custom op `op` whose implementation is `body`: under torch.compile the op (an opaque node
    with its fake implementation), in eager `body` itself, without the dispatcher's round trip, which takes more host
    time per call than many of our kernels take on the GPU. Autograd is then an autograd.Function around the
    entries (the same in both modes), not the op's registered formula."""

    def call(*args):
        return op._opoverload(*args) if torch.compiler.is_compiling() else body(*args)

    return call


def as_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] -> [rows, width] with unit stride along width (a view when possible), the row-strided layout
    the kernel wrappers pass on (a slice of a packed projection keeps its row stride, no copy)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when `device` has no index), looked up once."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
