"""`ops.warm_start`: its list of kernel modules is the set the package imports on first use, each of them imports,
and off CUDA it starts nothing."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

import hybrid_attention
from hybrid_attention.ops import warm_start as ws
from hybrid_attention.ops.triton_support import triton_available

PACKAGE = Path(hybrid_attention.__file__).parent
# Also imported inside functions, but not kernel modules: helpers, this module and the optional FLA backend.
NOT_KERNELS = {
    "hybrid_attention.ops.triton_cache",
    "hybrid_attention.ops.triton_support",
    "hybrid_attention.ops.kda.fla_backend",
    "hybrid_attention.ops.warm_start",
}


def deferred_op_imports() -> set[str]:
    """Every `hybrid_attention.ops...` module the package imports inside a function body."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybrid_attention.ops"):
                    found.add(node.module)
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names if a.name.startswith("hybrid_attention.ops"))
    return found


def test_kernel_modules_are_the_deferred_imports():
    assert set(ws.KERNEL_MODULES) == deferred_op_imports() - NOT_KERNELS


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("name", ws.KERNEL_MODULES)
def test_every_kernel_module_imports(name):
    assert importlib.import_module(name).__name__ == name


def test_nothing_to_warm_off_cuda(monkeypatch):
    imported = []
    monkeypatch.setattr(ws.importlib, "import_module", imported.append)
    monkeypatch.setattr(ws, "_thread", None)
    assert ws.warm_start(torch.device("cpu")) is None
    assert ws.warm_start("cpu", modules=["hybrid_attention.ops.gemv"]) is None
    assert imported == [], "a CPU run imported kernel modules"
    ws.wait_warm_start()  # no thread: returns at once


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_wait_joins_the_thread(monkeypatch):
    """The thread runs the first calls once; wait_warm_start returns after it ended."""
    calls = []
    monkeypatch.setattr(ws, "_thread", None)
    monkeypatch.setattr(ws, "_first_calls", lambda device, dtype: calls.append((device, dtype)))
    thread = ws.warm_start("cuda:0", modules=[], dtype=torch.float16)
    assert thread is not None and ws.warm_start("cuda:0") is thread
    ws.wait_warm_start()
    assert not thread.is_alive()
    assert calls == [(torch.device("cuda:0"), torch.float16)]


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
def test_first_calls_leave_the_default_generator_alone():
    torch.cuda.manual_seed(0)
    state = torch.cuda.get_rng_state()
    ws._first_calls(torch.device("cuda"), torch.bfloat16)
    assert torch.equal(torch.cuda.get_rng_state(), state), "the warm-up drew from the default CUDA generator"
