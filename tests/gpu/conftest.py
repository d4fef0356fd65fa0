"""GPU tests run each autotuned kernel's first config (an empty Triton cache would otherwise tune every config for
every shape class), unless a module is marked `tuned`; the configs themselves are checked one by one
(ops/kda/test_triton_gpu.py::test_every_autotune_config, ops/attnres/test_attnres_gpu.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _first_kernel_configs(request):
    if not torch.cuda.is_available() or request.node.get_closest_marker("tuned"):
        yield
        return
    from hybrid_attention.ops.triton_cache import first_configs_only

    with first_configs_only():
        yield
