"""Every benchmark script runs from any directory: started from inside benchmarks/, each parses its flags, and the
files it writes by default land beside it, not under the working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO_ROOT, checkout_env

BENCHMARKS = REPO_ROOT / "benchmarks"
HELPERS = {"bench_common.py", "serve_load.py", "train_cases.py"}  # modules the scripts import, with no command line

# `python NAME.py --help` for every script, in one process: each run as __main__ with its folder first on sys.path, as
# Python runs a script; then bench_decode's plot path as parsed with no flags.
CHILD = """
import contextlib, io, json, runpy, sys
from pathlib import Path
here, helpers, codes = Path(sys.argv[1]), sys.argv[2].split(","), {}
for script in sorted(here.glob("*.py")):
    if script.name in helpers:
        continue
    sys.argv, sys.path[0] = [str(script), "--help"], str(here)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
        codes[script.name] = "returned without --help's exit"
    except SystemExit as e:
        codes[script.name] = e.code
    except Exception as e:
        codes[script.name] = repr(e)
import bench_decode
print(json.dumps({"codes": codes, "plot": bench_decode.build_parser().parse_args([]).plot}))
"""


def test_every_benchmark_starts_from_inside_its_folder():
    env = checkout_env()
    argv = [sys.executable, "-c", CHILD, str(BENCHMARKS), ",".join(HELPERS)]
    done = subprocess.run(argv, cwd=BENCHMARKS, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - HELPERS
    assert result["codes"] == dict.fromkeys(sorted(scripts), 0)
    assert os.path.realpath(result["plot"]) == os.path.realpath(BENCHMARKS / "decode_latency.png")
