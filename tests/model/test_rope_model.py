"""HybridLM with RoPE on its MLA layers (`mla_rope`, the position-encoded baseline): incremental decoding equals the
full forward, causality, the config round trip, and that the order of the context reaches the logits only with it."""

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close
from tests.model.test_model import assert_incremental_equals_full, randomize_attnres, tiny_model


def test_incremental_decoding_equals_full_forward():
    model = tiny_model(layer_types=("mla", "mla"), mla_rope=True, mla_rope_theta=100.0)
    randomize_attnres(model)
    assert_incremental_equals_full(model, "RoPE", prefill=8, chunk_end=15, total=25)


def test_causal():
    model = tiny_model(layer_types=("mla", "mla"), mla_rope=True)
    ids = torch.randint(0, 256, (1, 30))
    changed = ids.clone()
    changed[:, 19:] = torch.randint(0, 256, (1, 11))
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert_close("logits before the change", a[:, :19], b[:, :19], 1e-12)
    assert not torch.allclose(a[:, 19:], b[:, 19:])


@pytest.mark.parametrize("rope", [False, True])
def test_context_order_reaches_the_logits_only_with_rope(rope):
    """One MLA layer, standard residual: the last token attends to all earlier ones, which NoPE sees as a set (a
    shuffle of them leaves its logits unchanged) and RoPE sees in order."""
    model = tiny_model("standard", layer_types=("mla",), mla_rope=rope, mla_rope_theta=100.0)
    ids = torch.randint(0, 256, (2, 16))
    shuffled = ids.clone()
    shuffled[:, :15] = ids[:, torch.randperm(15, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        last, last_shuffled = model(ids).logits[:, -1], model(shuffled).logits[:, -1]
    change = ((last - last_shuffled).norm() / last.norm()).item()
    if rope:
        assert change > 1e-4, f"RoPE: shuffling the context changed the logits by only {change:.2e}"
    else:
        assert change < 1e-12, f"NoPE: shuffling the context changed the logits by {change:.2e}"


def test_config():
    cfg = HybridConfig.from_preset("tiny", mla_rope=True, mla_rope_theta=5e5)
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    assert HybridLM(cfg).layers[3].mixer.rope_theta == 5e5
    assert HybridLM(HybridConfig.from_preset("tiny")).layers[3].mixer.rope_theta is None
    with pytest.raises(ValueError, match="even"):
        HybridConfig.from_preset("tiny", mla_rope=True, mla_qk_shared_head_dim=5)
    with pytest.raises(ValueError, match="mla_rope="):
        HybridConfig.from_preset("tiny", mla_rope="yes")
    with pytest.raises(ValueError, match="mla_rope_theta"):
        HybridConfig.from_preset("tiny", mla_rope=True, mla_rope_theta=1.0)
