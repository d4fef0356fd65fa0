"""What the AttnRes training kernels share: the pointer table that lets one kernel read a list of separate source
tensors (each stored once, never stacked), the compute dtype, and the grid of the row-looping backward kernels.

A kernel reads source i of row m at `table[i] + m * D`: `table` is an int64 tensor of the sources' data pointers,
cast to a pointer of the sources' element type inside the kernel (works compiled and under the interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_attention.ops.triton_support import TRITON_DTYPES, interpreting, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works
    triton = None

MAX_ROW = 16384  # widest D held in registers: every training kernel keeps whole rows (our models use 1024)
BWD_PROGRAMS_PER_SM = 4  # backward programs loop over rows to sum parameter gradients in registers


def fused_train_supported(x: torch.Tensor) -> bool:
    """The training kernels can take sources like `x` [..., D]: triton installed, CUDA (or CPU under the
    interpreter, where float64 works too, for tests), a supported dtype and D <= MAX_ROW."""
    if not triton_available() or x.shape[-1] > MAX_ROW:
        return False
    if x.is_cuda:
        return x.dtype in TRITON_DTYPES
    return x.device.type == "cpu" and interpreting() and (x.dtype in TRITON_DTYPES or x.dtype == torch.float64)


def compute_tl_dtype(dtype: torch.dtype):
    """float64 math for float64 tensors (interpreter tests), float32 for everything else."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> a contiguous tensor (a no-op for the outputs of linear layers and the embedding)."""
    return x if x.is_contiguous() else x.contiguous()


def pointer_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [S] of data pointers on the tensors' device. On CUDA the copy goes through pinned memory without
    blocking the host (a pageable copy would wait for the device)."""
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    device = tensors[0].device
    if device.type != "cuda":
        return ptrs
    return ptrs.pin_memory().to(device, non_blocking=True)


def row_programs(M: int, device: torch.device) -> int:
    """Programs for a backward kernel over M rows: enough to fill the GPU, few enough that the per-program partial
    parameter gradients [programs, D] stay small."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(M, BWD_PROGRAMS_PER_SM * sms))
    return max(1, min(M, 4))


def split_scalar(x: float) -> tuple[float, float]:
    """x as hi + lo, two float32 kernel arguments: float64 kernels (interpreter tests) add them back and see x to
    about 48 bits, where one float32 argument would round an epsilon by 1e-8 relative (visible at small norms)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(x) - hi


def block_d(D: int) -> int:
    return triton.next_power_of_2(D)
