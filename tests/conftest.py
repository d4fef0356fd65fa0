"""Test setup: the Triton interpreter without a GPU (TRITON_INTERPRET must be set before triton is first imported, so
it is set here, at collection time), the CPU thread count, and shared fixtures. Markers and the device: helpers.py."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep CPU runs reproducible and quick on small machines.
torch.set_num_threads(min(torch.get_num_threads(), 2))


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
