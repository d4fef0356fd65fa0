"""An exported folder on a CUDA GPU through transformers' remote code, in a process where hybrid_attention cannot be
imported: the folder's own copy of the package (Triton kernels and custom ops included) loads, and greedy generation
gives the tokens of the installed package's route. Run: `python -m pytest -q tests/gpu/hf/test_remote_code_gpu.py`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

import hybrid_attention.hf  # noqa: E402, F401  registers the model type: the route without the folder's code
from hybrid_attention import cli  # noqa: E402
from tests.helpers import needs_cuda  # noqa: E402
from tests.hf.test_remote_code import HIDDEN  # noqa: E402

pytestmark = needs_cuda

# HIDDEN, then greedy generation on the GPU in bf16 from the folder's own code.
GENERATE = (
    HIDDEN
    + """
model = model.to("cuda", torch.bfloat16)
out = model.generate(input_ids=ids.cuda(), max_new_tokens=24, do_sample=False)
print(json.dumps(out[0].tolist()))
"""
).replace("import torch\n", "import json, torch\n", 1)


def test_remote_code_generates_on_the_gpu_as_the_installed_package(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("".join(f"def k{i}(t):\n    return t + {i}\n\n" for i in range(400)))
    run, folder = tmp_path / "run", tmp_path / "tiny-hf"
    argv = ["train", "--out", run, "--data", data, "--steps", 4, "--batch-size", 2, "--seq-len", 64, "--device", "cuda"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([str(a) for a in argv]) == 0
        assert cli.main(["export", "--ckpt", str(run), "--hf", str(folder)]) == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    argv = [sys.executable, "-c", GENERATE, str(folder), str(tmp_path / "logits.pt")]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads(done.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(folder).to("cuda", torch.bfloat16)
    ids = torch.tensor([[100, 101, 102, 32, 120]], device="cuda")
    local = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)[0].tolist()
    assert remote == local
