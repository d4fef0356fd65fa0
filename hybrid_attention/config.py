"""The model's settings: `HybridConfig`, one flat dataclass, and its named presets (`PRESETS`).

`HybridConfig.from_preset("k3-scaled", **overrides)`; `to_dict` / `from_dict` are what a run's config.json stores.
Every field is checked when the config is built; which kernels run is not a model setting (`HybridLM` takes it).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from hybrid_attention.checks import check_lower_bound
from hybrid_attention.choices import GATE_FORMS, LAYER_TYPES, RESIDUALS

# Execution choices that run directories written before they became load-time arguments stored with the model
# (`HybridLM(config, kda_backend=..., attnres_backend=...)`); `from_dict` drops them and says so.
EXECUTION_FIELDS = ("kda_backend", "attnres_backend")


class IgnoredSetting(UserWarning):
    """A stored setting that no longer applies (the command line prints it as one line)."""


def _k3_layer_types(all_mla: bool = False, groups: int = 3) -> tuple[str, ...]:
    # Groups of 3 KDA + 1 MLA, then a final MLA: with 3 groups KDA at layers 1-3, 5-7, 9-11 and MLA at 4, 8, 12, 13.
    pattern = ("kda", "kda", "kda", "mla") * groups + ("mla",)
    return tuple("mla" for _ in pattern) if all_mla else pattern


PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized: tests and the quick start.
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        layer_types=("kda", "kda", "kda", "mla"),
        intermediate_size=192,
        kda_num_heads=2,
        kda_head_dim=32,
        mla_num_heads=2,
        mla_kv_lora_rank=32,
        mla_qk_nope_head_dim=16,
        mla_qk_shared_head_dim=16,
        mla_v_head_dim=32,
        residual="attnres",
    ),
    # The 13-layer scaled configuration (hidden 1024, 8 heads of 128 for both mixers).
    "k3-scaled": dict(
        vocab_size=8192,
        hidden_size=1024,
        layer_types=_k3_layer_types(),
        intermediate_size=2816,
        kda_num_heads=8,
        kda_head_dim=128,
        mla_num_heads=8,
        mla_kv_lora_rank=256,
        mla_qk_nope_head_dim=96,
        mla_qk_shared_head_dim=32,
        mla_v_head_dim=128,
        residual="attnres",
    ),
}
# The full-attention baseline of the Kimi Linear report: every layer Gated MLA, same sizes.
PRESETS["k3-scaled-all-mla"] = dict(PRESETS["k3-scaled"], layer_types=_k3_layer_types(all_mla=True))
# Block AttnRes at about 8 blocks over the depth, the granularity the AttnRes paper recommends: blocks of two
# decoder layers (4 sublayers), so 7 blocks over the 26 sublayers and, with the embedding, 8 block sums at the end.
PRESETS["k3-scaled-block"] = dict(PRESETS["k3-scaled"], residual="block_attnres", attnres_block_size=4)
# Pretraining sizes in the same layout, heads of 128 and a SwiGLU of 8/3 x hidden rounded up to a multiple of 256 (as
# Llama sizes it), with Block AttnRes in blocks of 8 sublayers: one group of 3 KDA + 1 MLA per block, so the final MLA
# layer closes one more block and the last AttnRes mixes as many block sums as k3-scaled-block's (docs/training.md).
_PRETRAINING = dict(
    vocab_size=8192,
    kda_head_dim=128,
    mla_kv_lora_rank=512,
    mla_qk_nope_head_dim=96,
    mla_qk_shared_head_dim=32,
    mla_v_head_dim=128,
    residual="block_attnres",
    attnres_block_size=8,
)
# 25 layers (18 KDA + 7 MLA) at hidden 2048: about 1.3B parameters.
PRESETS["k3-1b"] = dict(
    _PRETRAINING,
    hidden_size=2048,
    layer_types=_k3_layer_types(groups=6),
    intermediate_size=5632,
    kda_num_heads=16,
    mla_num_heads=16,
)
# 29 layers (21 KDA + 8 MLA) at hidden 3072, Llama 3.2 3B's width, heads and FFN: about 3.3B parameters.
PRESETS["k3-3b"] = dict(
    _PRETRAINING,
    hidden_size=3072,
    layer_types=_k3_layer_types(groups=7),
    intermediate_size=8192,
    kda_num_heads=24,
    mla_num_heads=24,
)


@dataclass
class HybridConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    layer_types: tuple[str, ...] = ("kda", "kda", "kda", "mla")
    intermediate_size: int = 192
    residual: str = "attnres"
    attnres_block_size: int = 2  # sublayers per block (attention and MLP count separately); block_attnres only
    norm_eps: float = 1e-6
    # KDA mixer
    kda_num_heads: int = 2
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_lower_bound: float = -5.0  # the "bounded" gate's
    kda_gate: str = "bounded"  # the decay gate: "bounded", "softplus" or "head" (see ops/kda/gate.py)
    # Gated MLA mixer (NoPE)
    mla_num_heads: int = 2
    mla_kv_lora_rank: int = 32
    mla_qk_nope_head_dim: int = 16
    mla_qk_shared_head_dim: int = 16
    mla_v_head_dim: int = 32
    mla_q_lora_rank: int | None = None
    mla_output_gate: bool = True  # the sigmoid gate on the heads (False: plain MLA with NoPE, as in Kimi Linear)
    mla_rope: bool = False  # RoPE on the shared key part (a position-encoded baseline; the recipe is NoPE)
    mla_rope_theta: float = 10000.0  # the rotary base, with mla_rope
    # Embeddings and init
    tie_embeddings: bool = False
    init_std: float = 0.02
    num_layers: int = field(init=False)

    def __post_init__(self):
        self.layer_types = tuple(self.layer_types)
        self.num_layers = len(self.layer_types)
        if self.num_layers == 0:
            raise ValueError("HybridConfig: layer_types is empty; expected at least one of 'kda' or 'mla'")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"HybridConfig: layer_types[{i}] = {kind!r}; expected one of {LAYER_TYPES}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"HybridConfig: residual={self.residual!r}; expected one of {RESIDUALS}")
        positive = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "attnres_block_size",
            "kda_num_heads",
            "kda_head_dim",
            "kda_conv_size",
            "mla_num_heads",
            "mla_kv_lora_rank",
            "mla_qk_nope_head_dim",
            "mla_v_head_dim",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HybridConfig: {name}={value!r}; expected a positive integer")
        if not isinstance(self.mla_qk_shared_head_dim, int) or self.mla_qk_shared_head_dim < 0:
            raise ValueError(f"HybridConfig: mla_qk_shared_head_dim={self.mla_qk_shared_head_dim!r}; expected >= 0")
        if self.mla_q_lora_rank is not None and (not isinstance(self.mla_q_lora_rank, int) or self.mla_q_lora_rank < 1):
            raise ValueError(f"HybridConfig: mla_q_lora_rank={self.mla_q_lora_rank!r}; expected None or >= 1")
        if self.kda_gate not in GATE_FORMS:
            raise ValueError(f"HybridConfig: kda_gate={self.kda_gate!r}; expected one of {GATE_FORMS}")
        if not isinstance(self.mla_output_gate, bool):
            raise ValueError(f"HybridConfig: mla_output_gate={self.mla_output_gate!r}; expected True or False")
        if not isinstance(self.mla_rope, bool):
            raise ValueError(f"HybridConfig: mla_rope={self.mla_rope!r}; expected True or False")
        if self.mla_rope and (self.mla_qk_shared_head_dim < 2 or self.mla_qk_shared_head_dim % 2):
            raise ValueError(
                f"HybridConfig: mla_rope rotates the shared key part in pairs of channels; mla_qk_shared_head_dim="
                f"{self.mla_qk_shared_head_dim} must be even and >= 2"
            )
        theta = self.mla_rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
            raise ValueError(f"HybridConfig: mla_rope_theta={theta!r}; expected a number > 1")
        check_lower_bound(self.kda_lower_bound, name="HybridConfig: kda_lower_bound")
        if not self.norm_eps > 0:
            raise ValueError(f"HybridConfig: norm_eps={self.norm_eps}; expected > 0")
        if not self.init_std > 0:
            raise ValueError(f"HybridConfig: init_std={self.init_std}; expected > 0")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> HybridConfig:
        """A named preset (see `PRESETS`: "tiny", "k3-scaled", "k3-scaled-all-mla", "k3-scaled-block", "k3-1b",
        "k3-3b") with keyword overrides of any field."""
        if name not in PRESETS:
            raise ValueError(f"HybridConfig: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (derived ones left out)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        """Inverse of `to_dict`; unknown keys raise ValueError. The execution choices older run directories stored
        (`EXECUTION_FIELDS`) are dropped with an `IgnoredSetting` warning when they asked for anything but "auto"."""
        for name in EXECUTION_FIELDS:
            if name in d and d[name] != "auto":
                flag = "--" + name.replace("_", "-")
                warnings.warn(
                    f"the stored model config sets {name}={d[name]!r}, which is now chosen when the model is loaded "
                    f"({flag}, default auto); the stored value is ignored",
                    IgnoredSetting,
                    stacklevel=2,
                )
        d = {k: v for k, v in d.items() if k not in EXECUTION_FIELDS}
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - known - {"num_layers"})
        if unknown:
            raise ValueError(f"HybridConfig: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if k in known})
