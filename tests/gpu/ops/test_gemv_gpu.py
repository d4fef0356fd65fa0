"""The decode GEMV kernel (`ops.gemv`) on a CUDA GPU at k3-scaled shapes against F.linear in float64, and a
CUDA-graph decode step routed through it (`DecodeStep(gemv="triton")`) against one on cuBLAS. Run:
`python -m pytest -q tests/gpu/ops/test_gemv_gpu.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_as_accurate, needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("M", [1, 32])
@pytest.mark.parametrize("N, K", [(3336, 1024), (1024, 2816), (8192, 1024), (1024, 128)])
def test_gemv_as_accurate_as_cublas(M, N, K):
    from hybrid_attention.ops.gemv import gemv

    torch.manual_seed(N + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    ref = F.linear(x.double(), w.double())
    # Both round a float32 sum to bf16: within 2x of cuBLAS' error, or within bf16's unit roundoff.
    assert_as_accurate(f"gemv M={M} N={N} K={K}", gemv(x, w), ref, F.linear(x, w), floor=2**-8)


def test_graph_decode_through_the_gemv():
    """Both bf16 decodes round differently, and 4 layers amplify that (about 2e-2 apart): each is held
    against the float64 full forward, the Triton GEMV's decode as accurate as the cuBLAS one."""
    from hybrid_attention.inference.decode_graph import DecodeStep
    from hybrid_attention.ops.backends import use_reference
    from tests.gpu.inference.test_generate_gpu import K3_BLOCK, float64_copy, make_model, prompt

    model = make_model(layer_types=K3_BLOCK)
    ids = prompt(2, 6, model.config.vocab_size)
    logits = {}
    for mode in ("torch", "triton"):
        step = DecodeStep(model, model.make_cache(2, 8), cuda_graph=True, gemv=mode)
        logits[mode] = torch.stack([step(ids[:, t]).clone() for t in range(ids.shape[1])], 1).float()
    with torch.no_grad(), use_reference():
        ref64 = float64_copy(model)(ids).logits
    assert_as_accurate("graph decode with the Triton GEMV", logits["triton"], ref64, logits["torch"])
