"""Test setup and the markers and device every test file shares.

Triton kernels run under the interpreter when there is no GPU: TRITON_INTERPRET must be set before triton is first
imported, so it is set here, at collection time, before anything below imports it.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybrid_attention.ops.triton_support import triton_runs_on  # noqa: E402

# Keep CPU runs reproducible and quick on small machines.
torch.set_num_threads(min(torch.get_num_threads(), 2))

# Where the tests that run on either device put their tensors: the GPU when there is one, else the CPU (with the
# Triton kernels under the interpreter).
DEV = "cuda" if torch.cuda.is_available() else "cpu"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(
    not triton_runs_on(torch.empty(1, device=DEV)), reason="needs triton and CUDA or TRITON_INTERPRET=1"
)


@pytest.fixture
def quiet_transformers():
    """transformers' logging at errors only for the test (its reference layers warn once per kernel that they fall
    back to PyTorch); the verbosity is restored after."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture
def poisoned(monkeypatch):
    """While active, torch.empty / empty_like return NaN-filled tensors: an output element a kernel forgets to write
    fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like
    # torch.compile's table of torch functions is built once, from torch's attributes at that moment: build it now,
    # from the real ones, or a later compile in this process would meet a torch.empty it does not know.
    torch._dynamo.trace_rules.get_torch_obj_rule_map()

    def nan_fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_fill(empty_like(*a, **k)))
