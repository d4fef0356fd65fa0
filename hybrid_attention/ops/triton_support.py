"""What every Triton kernel of the package shares: whether one can run here (one answer for every dispatcher and fused
path: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), the autotuner, and the launch arithmetic."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch paths work without it
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BWD_PROGRAMS_PER_SM = 4  # backward programs loop over rows to sum parameter gradients in registers


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


def autotune(options: list[dict], warps_stages: list[tuple[int, int]], key: list[str]):
    """triton.autotune over a few configs. Only the first config is used under the interpreter (it would run
    them all, slowly). A config that does not fit the GPU (registers, shared memory) is skipped by the autotuner.
    Every config stays listed in the returned tuner's `all_configs`, so tests can run each one alone (also under the
    interpreter). The choices are kept on disk across processes, and `first_configs_only` reaches the tuner
    (`ops/triton_cache.py`)."""
    from hybrid_attention.ops.triton_cache import AUTOTUNE_OPTIONS, register_tuner

    configs = [triton.Config(o, num_warps=w, num_stages=s) for o, (w, s) in zip(options, warps_stages, strict=True)]

    def decorate(fn):
        tuner = triton.autotune(configs=configs[:1] if interpreting() else configs, key=key, **AUTOTUNE_OPTIONS)(fn)
        tuner.all_configs = configs
        return register_tuner(tuner)

    return decorate


def next_power_of_2(n: int) -> int:
    """Plain Python (triton.next_power_of_2 is a jit function, slow to call from the host for every launch)."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def split_scalar(x: float) -> tuple[float, float]:
    """x as hi + lo, two float32 kernel arguments: float64 kernels (interpreter tests) add them back and see x to
    about 48 bits, where one float32 argument would round an epsilon by 1e-8 relative (visible at small norms)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(x) - hi


def row_programs(M: int, device: torch.device, per_sm: int = BWD_PROGRAMS_PER_SM) -> int:
    """Programs for a backward kernel over M rows: enough to fill the GPU, few enough that the per-program partial
    parameter gradients [programs, D] stay small."""
    if device.type == "cuda":
        return max(1, min(M, per_sm * sm_count(device)))
    return max(1, min(M, 4))


def compute_tl_dtype(dtype: torch.dtype):
    """float64 math for float64 tensors (interpreter tests), float32 for everything else."""
    return tl.float64 if dtype == torch.float64 else tl.float32
