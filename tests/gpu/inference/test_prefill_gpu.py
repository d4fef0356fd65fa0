"""Chunked prefill on a CUDA GPU at k3-scaled sizes: a 64K-token prompt prefilled in chunks (MLA chunks attending to
the cached prefix in the decompressed form) gives the last logits of one forward over the whole prompt, within bf16
accuracy. Both are measured against the same model in float32 (one forward): the chunked logits must be as accurate
as the one-shot bf16 ones (within a factor of 2), and, on one 3:1 block, close to them directly."""

from __future__ import annotations

import copy

import pytest
import torch

import hybrid_attention.layers.mla as mla
from hybrid_attention.inference.prefill import prefill
from hybrid_attention.ops.mla.lse_attention import _failed
from tests.gpu.inference.test_generate_gpu import K3_BLOCK, make_model, prompt
from tests.helpers import assert_as_accurate, assert_close, needs_cuda

pytestmark = needs_cuda
T = 1 << 16


@pytest.mark.parametrize("layer_types", [K3_BLOCK, None], ids=["one-block", "k3-scaled"])
@pytest.mark.parametrize("chunk", [8192, None])
def test_chunked_64k_prefill_equals_one_forward(layer_types, chunk, monkeypatch):
    overrides = {} if layer_types is None else {"layer_types": layer_types}
    model = make_model("k3-scaled", torch.bfloat16, seed=3, **overrides)
    ids = prompt(1, T, model.config.vocab_size, seed=4)
    calls = []
    original = mla.mla_prefill
    monkeypatch.setattr(mla, "mla_prefill", lambda q, *a, **k: calls.append(k["prefix_len"]) or original(q, *a, **k))
    cache = model.make_cache(1, T)
    chunked = prefill(model, ids, cache, chunk_size=chunk)
    size = chunk or 1 << 15
    num_mla = sum(kind == "mla" for kind in model.config.layer_types)
    assert sorted(set(calls)) == list(range(0, T - 1, size)) and len(calls) == num_mla * len(set(calls))
    with torch.no_grad():
        one_shot = model(ids).logits[:, -1]
        reference = copy.deepcopy(model).float()(ids).logits[:, -1]
    assert_as_accurate(f"chunks of {size}", chunked.float(), reference, one_shot.float())
    if layer_types is not None:
        assert_close("chunked vs one forward", chunked.float(), one_shot.float(), 3e-2)
    assert not _failed, f"attention kernels that raised: {_failed}"
