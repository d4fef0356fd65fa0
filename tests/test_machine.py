"""What the machine has (machine.py) and a model's size from its config alone (model_size.py): the sizes equal a built
model's at any layer pattern, a deep config is sized at once, and a request beyond the memory is one line."""

from __future__ import annotations

import time

import pytest
import torch

from hybrid_attention import machine
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.model_size import check_model_fits, model_size


def built_size(config: HybridConfig) -> tuple:
    with torch.device("meta"):
        model = HybridLM(config)
    per_token, state = model.cache_bytes_per_token(torch.bfloat16), model.state_bytes_per_sequence(torch.bfloat16)
    return model.num_parameters(), model.embed.weight.numel(), model.layer_table(), per_token, state


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("tiny", {}),
        ("k3-scaled", {}),
        ("k3-scaled-block", {"layer_types": ("mla", "kda", "kda", "mla", "kda")}),
        ("tiny", {"layer_types": ("mla", "mla", "mla"), "residual": "standard", "tie_embeddings": True}),
        ("tiny", {"layer_types": ("kda",) * 7, "mla_q_lora_rank": 8}),
    ],
)
def test_model_size_is_the_built_models(preset, overrides):
    config = HybridConfig.from_preset(preset, **overrides)
    size = model_size(config)
    got = (size.parameters, size.embedding, size.layers, size.cache_bytes_per_token, size.state_bytes_per_sequence)
    assert got == built_size(config)


def test_a_deep_config_is_sized_at_once_and_refused_in_one_line(monkeypatch):
    shallow_types = ("kda", "kda", "kda", "mla")
    config = HybridConfig.from_preset("tiny", layer_types=shallow_types * 25_000)
    start = time.perf_counter()
    size = model_size(config)
    assert time.perf_counter() - start < 10  # building the 100,000 layers, even on meta, takes hours
    shallow = model_size(HybridConfig.from_preset("tiny"))
    first_group = sum(row["parameters"] for row in shallow.layers)
    later_group = sum(row["parameters"] for row in size.layers[4:8])
    assert later_group - first_group == 2 * config.hidden_size  # the first sublayer's missing AttnRes: query, key norm
    assert size.parameters == shallow.parameters + 24_999 * later_group and len(size.layers) == 100_000
    monkeypatch.setattr(machine, "memory_bytes", lambda device: 16 * 10**9)
    with pytest.raises(ValueError) as err:
        check_model_fits(config, "cpu", bytes_per_parameter=4, what="loading the model")
    message = str(err.value)
    assert f"loading the model ({size.parameters:,} parameters in 100,000 layers) would need at least" in message
    assert message.endswith("more than the 16 GB of memory free on this machine") and "\n" not in message
    check_model_fits(HybridConfig.from_preset("tiny"), "cpu", bytes_per_parameter=4, what="loading the model")


def test_memory_of_the_cpu_and_the_meta_device():
    total = machine.memory_bytes("cpu")
    assert total is None or 0 < total  # None off Linux
    assert machine.memory_bytes("meta") is None
    machine.check_fits(10**30, "anything", "meta")  # nothing is allocated on meta: never refused
    if total is not None:
        with pytest.raises(ValueError, match=r"^a step's token ids would need at least 1,000,000,000,000,000 PB, "):
            machine.check_fits(10**30, "a step's token ids", "cpu")


@pytest.mark.parametrize("n, text", [(5, "5 bytes"), (999, "999 bytes"), (1000, "1 kB"), (2.4e15, "2.4 PB")])
def test_format_bytes(n, text):
    assert machine.format_bytes(n) == text
