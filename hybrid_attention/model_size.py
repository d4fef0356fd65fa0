"""A model's size from its config alone: parameters per layer, in all and in bytes, from one layer of each type built on
the meta device (docs/training.md, "Sizes the machine cannot hold").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.machine import check_fits
from hybrid_attention.model import HybridLM


@dataclass(frozen=True)
class ModelSize:
    """What `HybridLM(config)` would hold. layers: one row per decoder layer (1-based index, type, parameters)."""

    parameters: int
    embedding: int
    layers: list[dict]
    cache_bytes_per_token: int  # MLA latent rows per token of context, bf16
    state_bytes_per_sequence: int  # KDA states and conv tails per sequence, fp32 state and bf16 tails
    # Per layer type: the parameters of its mixer and of its MLP, and its 2-D hidden matrices (Muon's share).
    sublayers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


def model_size(config: HybridConfig) -> ModelSize:
    kinds = tuple(dict.fromkeys(config.layer_types))
    # The first layer, then one more of each type: the first differs (its mixer reads the embedding alone, with no
    # AttnRes), every later layer of a type is the same.
    probe_types = (config.layer_types[0], *kinds)
    with torch.device("meta"):
        probe = HybridLM(dataclasses.replace(config, layer_types=probe_types))
    rows = probe.layer_table()
    per_type = {row["type"]: row["parameters"] for row in rows[1:]}
    rest = probe.num_parameters() - sum(row["parameters"] for row in rows)
    layers = [
        {"index": i + 1, "type": t, "parameters": rows[0]["parameters"] if i == 0 else per_type[t]}
        for i, t in enumerate(config.layer_types)
    ]
    count = {t: config.layer_types.count(t) for t in kinds}
    probe_count = {t: probe_types.count(t) for t in kinds}
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    sublayers = {
        layer.layer_type: {
            "mixer": numel(layer.mixer),
            "mlp": numel(layer.mlp),
            "matrices": sum(p.numel() for p in layer.parameters() if p.ndim == 2),
        }
        for layer in probe.layers[1:]
    }
    per_mla = probe.cache_bytes_per_token(torch.bfloat16) // max(1, probe_count.get("mla", 0))
    per_kda = probe.state_bytes_per_sequence(torch.bfloat16) // max(1, probe_count.get("kda", 0))
    return ModelSize(
        parameters=rest + sum(row["parameters"] for row in layers),
        embedding=probe.embed.weight.numel(),
        layers=layers,
        cache_bytes_per_token=count.get("mla", 0) * per_mla,
        state_bytes_per_sequence=count.get("kda", 0) * per_kda,
        sublayers=sublayers,
    )


def check_model_fits(
    config: HybridConfig, device: torch.device | str, *, bytes_per_parameter: float, what: str
) -> None:
    """ValueError, before anything is built, when `bytes_per_parameter` bytes per parameter (4: float32 weights; 16:
    weights, gradients and AdamW's two moments) cannot fit `device`. `what` names the work, e.g. "training the
    model"."""
    n = model_size(config).parameters
    check_fits(int(n * bytes_per_parameter), f"{what} ({n:,} parameters in {config.num_layers:,} layers)", device)
