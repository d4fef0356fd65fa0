"""A model built in code saved as a run directory: `load_run` gives back the same weights and tokenizer, and the
directory is refused when it is not new or the tokenizer does not fit the model."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.data.tokenizer import ByteTokenizer
from hybrid_attention.model import HybridLM
from hybrid_attention.runs.checkpoint import load_run
from hybrid_attention.training.model_run import save_model_run


def test_round_trip_and_refusals(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny"))
    out = save_model_run(tmp_path / "run", model, ByteTokenizer())
    loaded, config, tokenizer = load_run(out)
    assert tokenizer.kind == "byte" and config["model"] == model.config.to_dict()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="not empty"):
        save_model_run(out, model, ByteTokenizer())
    small = HybridLM(HybridConfig.from_preset("tiny", vocab_size=100))
    with pytest.raises(ValueError, match="256 tokens, the model 100"):
        save_model_run(tmp_path / "other", small, ByteTokenizer())
