"""Which implementation runs: one rule for every op and layer ("torch", "triton", "auto"), and `use_reference()`, the
switch that forces the PyTorch references (docs/kernels.md, "Backends: which implementation runs").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybrid_attention.choices import BACKENDS
from hybrid_attention.ops.triton_support import triton_runs_on

# Process-wide, like torch.backends' flags; a plain module global so that torch.compile guards on its value.
_fast_paths = True


def fast_paths_enabled() -> bool:
    """False inside `use_reference()` (or after `set_fast_paths(False)`)."""
    return _fast_paths


def set_fast_paths(enabled: bool) -> None:
    """Switch the fast paths on or off for the whole process (`use_reference` does it for a block)."""
    global _fast_paths
    if not isinstance(enabled, bool):
        raise ValueError(f"set_fast_paths: expected True or False, got {enabled!r}")
    _fast_paths = enabled


@contextmanager
def use_reference(enabled: bool = True) -> Iterator[None]:
    """Inside the block every "auto" backend and every fast path runs the PyTorch reference (enabled=False: the
    default rule). The previous setting is restored on exit, also after an error."""
    previous = _fast_paths
    set_fast_paths(not enabled)
    try:
        yield
    finally:
        set_fast_paths(previous)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd will want gradients through these tensors (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def use_triton(x: torch.Tensor, *, needs_backward: bool = False) -> bool:
    """The rule behind every "auto" and every fast path: fast paths on, triton installed, `x` a CUDA tensor of a
    kernel dtype (float16, bfloat16, float32), and not `needs_backward` (set by callers whose kernel has no
    backward while a gradient is needed)."""
    return _fast_paths and not needs_backward and triton_runs_on(x, cpu_interpreter=False)


def check_backend(backend: str, name: str, allowed: tuple[str, ...] = BACKENDS) -> None:
    """Raise ValueError naming `name` unless `backend` is one of `allowed`."""
    if backend not in allowed:
        raise ValueError(f"{name}: backend must be one of {allowed}, got {backend!r}")


def resolve(backend: str, x: torch.Tensor, *, name: str, needs_backward: bool = False) -> str:
    """ "auto" -> "triton" or "torch" by `use_triton(x, needs_backward=...)`; "torch" and "triton" as they are.
    Unknown names raise, naming `name`."""
    check_backend(backend, name)
    if backend == "auto":
        return "triton" if use_triton(x, needs_backward=needs_backward) else "torch"
    return backend
