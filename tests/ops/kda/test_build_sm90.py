"""Every Triton KDA kernel and AttnRes training kernel, forward and backward, compiles for an sm_90 GPU on a machine
without one.

The interpreter runs a kernel's body as Python, so it accepts code the Triton compiler rejects (a name bound in one
branch of a constexpr `if` and read under a runtime `if`, for example); this test runs the real compiler, through
`tools/kernel_stats.py`, which compiles each kernel's first config with a compile-only driver and Triton's bundled
ptxas.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

triton = pytest.importorskip("triton")

ROOT = REPO_ROOT
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ATTNRES_KERNELS = ["_full_fwd_kernel", "_full_bwd_kernel", "_param_grads_kernel", "_stream_local_kernel",
                   "_stream_bwd_kernel", "_du_kernel", "_partial_fwd_kernel", "_partial_bwd_kernel",
                   "_partial_bwd_rows_kernel", "_merge_norm_fwd_kernel", "_merge_norm_bwd_kernel"]  # fmt: skip
KERNELS = ["_prep_kernel", "_prep_redo_kernel", "_state_fwd_kernel", "_output_kernel", "_regate_kernel",
           "_state_bwd_kernel", "_score_grad_kernel", "_dqkg_kernel"]  # fmt: skip


@pytest.mark.skipif(not PTXAS.exists(), reason="needs the ptxas bundled with Triton's CUDA backend")
@pytest.mark.parametrize(
    "args",
    [["--shape", "1,130,2,64,64", "--dtype", "bf16"], ["--shape", "1,70,2,32,32", "--dtype", "fp16", "--softplus"]],
    ids=["bf16-bounded-gate", "fp16-softplus-gate"],
)
def test_every_kda_kernel_compiles_for_sm90(args):
    assert set(KERNELS) <= compiled(args)


@pytest.mark.skipif(not PTXAS.exists(), reason="needs the ptxas bundled with Triton's CUDA backend")
@pytest.mark.parametrize("args", [["--attnres", "1024", "--dtype", "bf16"], ["--attnres", "96", "--dtype", "fp32"]])
def test_every_attnres_training_kernel_compiles_for_sm90(args):
    assert set(ATTNRES_KERNELS) <= compiled(args)


def compiled(args) -> set[str]:
    """The kernels `tools/kernel_stats.py args` built, after checking that it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kernel_stats.py"), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return {line.split()[0] for line in run.stdout.splitlines()[1:] if line.strip()}
