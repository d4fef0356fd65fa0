"""The pretraining presets: their layout and sizes, counted on the meta device (nothing is allocated)."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_attention.config import PRESETS, HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.model_size import model_size

# Parameters at the preset's vocabulary (8,192) and at the byte tokenizer's (256), and the range each must stay in.
SIZES = {
    "k3-1b": ((1_329_639_456, 1_297_133_600), (1.0e9, 1.5e9)),
    "k3-3b": ((3_330_390_136, 3_281_631_352), (2.5e9, 3.5e9)),
}


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_parameters_stay_in_range(preset):
    counts, (low, high) = SIZES[preset]
    for vocab, count in zip((PRESETS[preset]["vocab_size"], 256), counts, strict=True):
        config = HybridConfig.from_preset(preset, vocab_size=vocab)
        with torch.device("meta"):
            built = HybridLM(config).num_parameters()
        assert model_size(config).parameters == built == count, (preset, vocab, built)
        assert low <= count <= high, f"{preset} at vocabulary {vocab}: {count:,} parameters, outside [{low}, {high}]"


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_k3_layout_and_usual_shapes(preset):
    c = HybridConfig.from_preset(preset)
    groups, last = c.layer_types[:-1], c.layer_types[-1]
    assert last == "mla" and len(groups) % 4 == 0
    assert all(groups[i : i + 4] == ("kda", "kda", "kda", "mla") for i in range(0, len(groups), 4))
    assert c.kda_head_dim == c.mla_v_head_dim == c.mla_qk_nope_head_dim + c.mla_qk_shared_head_dim == 128
    assert c.kda_num_heads * 128 == c.mla_num_heads * 128 == c.hidden_size
    assert c.intermediate_size == 256 * math.ceil(8 * c.hidden_size / 3 / 256)  # SwiGLU at 8/3, as Llama rounds it
    # Block AttnRes: one block per group of 3 KDA + 1 MLA layers, so about 8 block sums (the embedding's included).
    assert c.residual == "block_attnres" and c.attnres_block_size == 8
    sums = 1 + math.ceil(2 * c.num_layers / c.attnres_block_size)
    assert 7 <= sums <= 10, sums
