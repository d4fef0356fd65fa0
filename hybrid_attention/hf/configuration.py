"""`HybridAttentionConfig`: a transformers `PreTrainedConfig` holding exactly the fields of `HybridConfig`, read from it
(docs/transformers.md, "The config").
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from hybrid_attention.config import HybridConfig


def hybrid_fields() -> dict[str, Any]:
    """The init fields of `HybridConfig` with their defaults (JSON-able: `layer_types` as a list)."""
    return HybridConfig().to_dict()


class HybridAttentionConfig(PreTrainedConfig):
    """transformers configuration of a `HybridLM`: `HybridAttentionConfig(**HybridConfig.to_dict())` and back with
    `to_hybrid_config()`. Unknown keys are kept as transformers keeps them (as attributes), not passed to the model."""

    model_type = "hybrid_attention"

    def __post_init__(self, **kwargs):
        values = {name: kwargs.pop(name, default) for name, default in hybrid_fields().items()}
        values["layer_types"] = list(values["layer_types"])
        HybridConfig.from_dict(values)  # raises ValueError naming the bad field and what was expected
        for name, value in values.items():
            setattr(self, name, value)
        kwargs.pop("tie_word_embeddings", None)  # follows tie_embeddings, the model's own switch
        self.tie_word_embeddings = values["tie_embeddings"]
        super().__post_init__(**kwargs)

    @classmethod
    def from_hybrid_config(cls, config: HybridConfig, **kwargs) -> HybridAttentionConfig:
        """The transformers config of `config`; `kwargs` are transformers' own fields (e.g. `eos_token_id`)."""
        return cls(**config.to_dict(), **kwargs)

    def to_hybrid_config(self) -> HybridConfig:
        """The `HybridConfig` these fields describe."""
        return HybridConfig.from_dict({name: getattr(self, name) for name in hybrid_fields()})
