"""The GPU tests' kernel configs: each autotuned kernel (KDA, AttnRes training, decode GEMV) runs its first config,
unless a test module is marked `tuned`.

Autotuning compiles every config of a kernel for each new shape class and dtype, and these tests use many of
both, so on a machine with an empty Triton cache tuning alone would take most of the suite's time. Most tests check
what the model or the op computes, which any config computes alike; the configs themselves are checked one by one
(`test_kda_triton.py::test_every_autotune_config`, `test_attnres_gpu.py`, and on the CPU `test_attnres_train.py` and
`test_gemv.py`), and the modules marked `tuned` (the KDA standard shape and repeatable backward, the AttnRes kernels
at model sizes, the on-disk tuning cache) run the autotuner as a user's process does.
"""

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
