"""Where and in what precision a command runs: device and dtype resolution, autocast, and denormal flushing."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

_TORCH_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # choices.DTYPES


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build or machine has no CUDA device")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA ("cpu" elsewhere), as benchmark and report lines give it."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def resolve_dtype(device: torch.device, name: str) -> torch.dtype:
    """--dtype NAME on `device`: "auto" is bf16 on CUDA and float32 elsewhere. bfloat16 on the CPU is refused: on
    processors without bf16 instructions oneDNN runs the KDA short convolutions through a slow reference path."""
    if name == "bfloat16" and device.type == "cpu":
        raise ValueError(
            "--dtype bfloat16 is for CUDA devices; on the CPU use --dtype float32 (the default there): bf16 "
            "convolutions can take a very slow fallback path on processors without bf16 instructions"
        )
    return _TORCH_DTYPES[name] or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on CUDA by default; float32 (no autocast) on CPU unless --dtype bfloat16."""
    target = resolve_dtype(device, dtype)
    if target == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=target)


_flush_depth = 0  # open flush_denormals blocks (torch has no getter for the flag to restore)


@contextlib.contextmanager
def flush_denormals():
    """Flush denormal floats to zero on CPU inside the block (off again after the outermost one, torch's default).

    The chunkwise KDA reference produces denormals from long decay products; on CPU they slow a training step down
    up to 25x. Flushing them changes results by less than float32 resolution. Blocks nest (the CLI opens one around
    every command, `train` its own), and only the outermost turns flushing off.
    """
    global _flush_depth
    if _flush_depth == 0:
        torch.set_flush_denormal(True)
    _flush_depth += 1
    try:
        yield
    finally:
        _flush_depth -= 1
        if _flush_depth == 0:
            torch.set_flush_denormal(False)


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A device tensor holding `values`, queued behind the stream's work instead of waiting for it (through pinned
    memory, which torch's caching host allocator keeps from reuse until the copies queued on it have run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
