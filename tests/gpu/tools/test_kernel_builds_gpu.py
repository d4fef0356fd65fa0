"""tools/kernel_builds.py on a GPU: the working tree's prep kernel timed in every config, at a small shape."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.tuned]

TOOL = REPO_ROOT / "tools" / "kernel_builds.py"


def test_times_every_prep_config_of_the_working_tree():
    from hybrid_attention.ops.kda.kernels.prep import _prep_kernel

    args = [".", "--kernels", "prep", "--shape", "2,256,2,64", "--iters", "2"]
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:2] == [".", "prep"]]
    assert len(rows) == len(_prep_kernel.all_configs)
    for row in rows:
        kernel_ms, op_ms = float(row[-2]), float(row[-1])
        assert 0 < kernel_ms <= op_ms
