"""MLA with RoPE on the shared key part (`mla_rope`) on a CUDA GPU at k3-scaled sizes: CUDA-graph decoding (fused
row append, Triton decode kernel) equals the full recompute, and chunked prefill through the Triton prefill kernel is
as accurate as one call, both against the model in float64. Run: `python -m pytest -q
tests/gpu/layers/test_mla_rope_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.generate import generate
from hybrid_attention.inference.prefill import prefill
from hybrid_attention.layers.mla import MLACache
from hybrid_attention.ops.backends import use_reference
from tests.gpu.inference.test_generate_gpu import float64_copy, make_model, no_tf32, prompt  # noqa: F401
from tests.helpers import assert_as_accurate, needs_cuda

pytestmark = needs_cuda
ROPE = dict(mla_rope=True)


def test_graph_decoding_equals_full_recompute():
    model = make_model("k3-scaled-all-mla", torch.float32, seed=2, **ROPE)
    ids = prompt(2, 29, model.config.vocab_size, seed=3)
    out = generate(model, ids, 16, temperature=0, cuda_graph=True)
    seq = ids
    with torch.no_grad():
        for _ in range(16):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    cache = model.make_cache(2, 45)
    step = DecodeStep(model, cache, cuda_graph=True)
    prefill(model, seq[:, :29], cache)
    logits = torch.stack([step(seq[:, t]).clone() for t in range(29, 44)], dim=1)
    with torch.no_grad():
        full = model(seq[:, :44]).logits[:, 29:]
        with use_reference():
            ref64 = float64_copy(model)(seq[:, :44]).logits[:, 29:]
    assert_as_accurate("RoPE graph decode (float32)", logits, ref64, full)


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
