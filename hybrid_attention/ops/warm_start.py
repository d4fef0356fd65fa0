"""The fixed costs of a process's first kernel calls, paid on a daemon thread while a checkpoint loads instead of
before the first token (docs/inference.md, "The first token of a new process").
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterable

import torch

from hybrid_attention.ops.triton_support import triton_available

# The kernel modules the layers and ops import on first use of a Triton path (tests/ops/test_warm_start.py checks the
# list against the source tree).
KERNEL_MODULES = (
    "hybrid_attention.ops.act_mul",
    "hybrid_attention.ops.gated_norm",
    "hybrid_attention.ops.gemv",
    "hybrid_attention.ops.kda.decode_fused",
    "hybrid_attention.ops.kda.triton_chunk",
    "hybrid_attention.ops.kda.triton_step",
    "hybrid_attention.ops.mla.append",
    "hybrid_attention.ops.mla.triton_attention",
    "hybrid_attention.ops.mla.triton_decode",
    "hybrid_attention.ops.rms_norm",
    "hybrid_attention.ops.short_conv",
    "hybrid_attention.ops.swiglu",
)

_thread: threading.Thread | None = None
_lock = threading.Lock()  # two first calls from two threads still start one thread


def _first_calls(device: torch.device, dtype: torch.dtype) -> None:
    """Triton's cache key (cached by Triton for the process), then one small cuBLAS product, causal attention and
    sampling draw on `device`. Its own generator: the process's default one is left as the caller seeded it."""
    from triton.runtime import cache

    key = getattr(cache, "triton_key", None)
    if key is not None:
        key()
    generator = torch.Generator(device=device)
    a = torch.randn(64, 64, device=device, dtype=dtype, generator=generator)
    q = a.view(1, 1, 64, 64)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.multinomial(torch.softmax((a @ a).float(), dim=-1), 1, generator=generator)
    torch.cuda.synchronize(device)


def warm_start(
    device: torch.device | str, modules: Iterable[str] = KERNEL_MODULES, dtype: torch.dtype = torch.bfloat16
) -> threading.Thread | None:
    """On a CUDA device with triton installed: import `modules` here, then start the daemon thread of the one-time
    first-call costs (the Triton cache's key, the first library calls). Call it before a checkpoint loads, so that
    the two overlap. Once per process (later calls return the same thread). Returns the thread, or None where there
    is nothing to warm (no CUDA device, no triton). A failure inside the thread is not an error: the first real call
    then pays the same cost."""
    global _thread
    device = torch.device(device)
    if device.type != "cuda" or not triton_available():
        return None
    with _lock:
        if _thread is not None:
            return _thread
        for name in modules:
            importlib.import_module(name)

        def run() -> None:
            with contextlib.suppress(Exception):  # an optimisation only; the first real call reports a real problem
                _first_calls(device, dtype)

        _thread = threading.Thread(target=run, name="hybrid-attention-warm-start", daemon=True)
        _thread.start()
        return _thread


def wait_warm_start() -> None:
    """Join `warm_start`'s thread, if one was started."""
    if _thread is not None:
        _thread.join()
