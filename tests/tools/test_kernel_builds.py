"""tools/kernel_builds.py without a GPU: each build is read from its own copy (--list), and a bad revision is a
one-line error. Timing the builds needs a GPU (tests/gpu/tools/test_kernel_builds_gpu.py)."""

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytest.importorskip("triton")
REPO = REPO_ROOT
if not (REPO / ".git").exists():
    pytest.skip("needs the repository's git history", allow_module_level=True)
TOOL = REPO / "tools" / "kernel_builds.py"
# The commit before the dq/dk/dg kernel's V loop was pipelined again: its configs were one-stage ones.
ONE_STAGE_DQKG = "5bba131~1"


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)


def listed(stdout: str) -> dict[tuple[str, str], str]:
    """{(build, kernel): its configs} from the --list table."""
    rows = {}
    for line in stdout.splitlines():
        build, kernel, configs = line.split(None, 2)
        rows[build, kernel] = configs
    return rows


def test_list_reads_each_build_from_its_own_copy():
    done = run_tool(ONE_STAGE_DQKG, ".", "--list")
    assert done.returncode == 0, done.stderr
    rows = listed(done.stdout)
    for build in (ONE_STAGE_DQKG, "."):
        assert {"prep", "dqkg", "state_fwd", "state_bwd", "score_grad", "output"} <= {k for b, k in rows if b == build}
    assert rows[ONE_STAGE_DQKG, "dqkg"] == "warps=8 stages=1 | warps=4 stages=1"
    from hybrid_attention.ops.kda.kernels.dqkg import _dqkg_kernel

    ours = " | ".join(f"warps={c.num_warps} stages={c.num_stages}" for c in _dqkg_kernel.all_configs)
    assert rows[".", "dqkg"] == ours


def test_a_bad_revision_is_a_one_line_error():
    done = run_tool("no-such-revision", "--list")
    assert done.returncode != 0
    assert "'no-such-revision' is not a revision" in done.stderr and "Traceback" not in done.stderr
