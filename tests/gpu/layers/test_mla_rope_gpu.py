"""MLA with RoPE on the shared key part (`mla_rope`) on a CUDA GPU at k3-scaled sizes: chunked prefill through the
Triton prefill kernel is as accurate as one call, against the model in float64 (its CUDA-graph decoding is tested in
tests/gpu/inference/test_generate_gpu.py). Run: `python -m pytest -q
tests/gpu/layers/test_mla_rope_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.inference.prefill import prefill
from hybrid_attention.layers.mla import MLACache
from hybrid_attention.ops.backends import use_reference
from tests.gpu.inference.test_generate_gpu import float64_copy, make_model, no_tf32, prompt  # noqa: F401
from tests.helpers import assert_as_accurate, needs_cuda

pytestmark = needs_cuda
ROPE = dict(mla_rope=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_prefill_is_exact(dtype):
    """3001 tokens in chunks of 512 against one call, both against the float64 prefill: the rotated rows and the
    queries at their positions agree across chunks."""
    model = make_model("k3-scaled", dtype, seed=8, layer_types=("mla", "mla"), **ROPE)
    ids = prompt(1, 3001, model.config.vocab_size, seed=9)
    whole, chunked = model.make_cache(1, 3001), model.make_cache(1, 3001)
    a = prefill(model, ids, whole, chunk_size=4096)
    b = prefill(model, ids, chunked, chunk_size=512)
    ref_model = float64_copy(model)
    ref_cache = ref_model.make_cache(1, 3001)
    with use_reference():
        ref = prefill(ref_model, ids, ref_cache, chunk_size=4096)
    assert_as_accurate("last logits", b, ref, a)
    for x, y, r in zip(whole.layers, chunked.layers, ref_cache.layers, strict=True):
        if isinstance(x, MLACache):
            assert_as_accurate("rotated MLA rows", y.rows, r.rows, x.rows)
