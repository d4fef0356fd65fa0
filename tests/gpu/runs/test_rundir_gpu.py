"""The run directory's guards on CUDA: divergence caught from device-side flags, token ids checked on request
without leaving CUDA unusable, generation at a tiny temperature (skips without CUDA).

Run on a GPU machine: python -m pytest -q tests/gpu/runs/test_rundir_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hybrid_attention import cli
from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.generate import generate
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FAST = ["--steps", "4", "--batch-size", "4", "--seq-len", "64", "--data-max-bytes", "200000", "--eval-batches", "1",
        "--log-every", "1", "--eval-every", "2", "--device", "cuda"]  # fmt: skip


def test_divergence_is_caught_on_cuda(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "--out", str(out), *FAST, "--lr", "1e30"])
    err = capsys.readouterr().err
    assert code == 1 and "training diverged: the loss or the gradient norm is not finite at step" in err, err
    assert ckpt.latest_checkpoint(out) is None


def test_token_ids_are_checked_on_request_and_cuda_stays_usable():
    model = HybridLM(HybridConfig.from_preset("tiny")).cuda().eval()
    model.check_token_ids = True
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\), got \[1, 300\]"):
        model(torch.tensor([[1, 300]], device="cuda"))
    assert model(torch.tensor([[1, 2]], device="cuda")).logits.isfinite().all()


def test_a_tiny_temperature_is_greedy_on_cuda():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny")).cuda().eval()
    prompt = torch.tensor([[5, 6, 7]], device="cuda")
    assert torch.equal(generate(model, prompt, 8, temperature=1e-45), generate(model, prompt, 8, temperature=0))
