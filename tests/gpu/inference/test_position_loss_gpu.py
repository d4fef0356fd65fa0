"""The loss against position on a CUDA GPU at k3-scaled sizes: bf16 windows of 32K tokens through the cache in chunks
(the chunk size from the free memory, logits included) as accurate as one call against the float64 model, and the
peak memory bounded. Run: `python -m pytest -q tests/gpu/inference/test_position_loss_gpu.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.inference.position_loss import logits_chunk_size, token_losses
from hybrid_attention.inference.prefill import activation_budget
from hybrid_attention.ops.backends import use_reference
from tests.gpu.inference.test_generate_gpu import float64_copy, make_model, no_tf32, prompt  # noqa: F401
from tests.helpers import assert_as_accurate, needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("preset", ["k3-scaled", "k3-scaled-all-mla"])
def test_chunked_losses_as_accurate_as_one_call(preset):
    model = make_model(preset, torch.bfloat16, seed=1)
    x = prompt(2, 3001, model.config.vocab_size, seed=2)
    chunked = token_losses(model, x, chunk_size=512)
    whole = token_losses(model, x, chunk_size=4096)
    with torch.no_grad(), use_reference():
        logits = float64_copy(model)(x).logits
    ref = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
    assert_as_accurate(f"{preset} per-token losses", chunked, ref, whole)


def test_32k_windows_fit_in_bounded_memory():
    model = make_model("k3-scaled", torch.bfloat16, seed=3)
    x = prompt(2, 32768, model.config.vocab_size, seed=4)
    budget = activation_budget(x.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    nll = token_losses(model, x)
    peak = torch.cuda.max_memory_allocated() - before
    chunk = logits_chunk_size(model, 2)
    print(f"32K windows x 2: chunks of {chunk:,} tokens, peak {peak / 2**30:.2f} GiB over the weights")
    assert nll.shape == (2, 32767) and torch.isfinite(nll).all()
    assert peak < budget, f"peak {peak / 2**30:.1f} GiB above the prefill budget {budget / 2**30:.1f} GiB"
    # A random model predicts about uniformly: the mean loss near ln(vocab).
    assert abs(nll.mean().item() - torch.log(torch.tensor(float(model.config.vocab_size))).item()) < 1.0
