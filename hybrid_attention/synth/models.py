"""The models of the synthetic suite: 2 layers, 2 heads of 128, every layer one mixer kind: "kda", "gdn" (one decay per
head) or "mla" (docs/fidelity.md, "The synthetic suite").
"""

from __future__ import annotations

from hybrid_attention.config import HybridConfig

MODELS = ("kda", "gdn", "mla")


def model_config(
    model: str,
    vocab_size: int,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 128,
    residual: str = "standard",
) -> HybridConfig:
    """HybridConfig of `model` ("kda", "gdn" or "mla"): hidden size num_heads * head_dim, a 8/3-wide SwiGLU (rounded
    up to 64), MLA with a latent as wide as the hidden state and a quarter of each query-key head shared."""
    if model not in MODELS:
        raise ValueError(f"unknown synthetic model {model!r}; expected one of {', '.join(MODELS)}")
    hidden = num_heads * head_dim
    shared = head_dim // 4
    return HybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        layer_types=("mla" if model == "mla" else "kda",) * num_layers,
        intermediate_size=-(-8 * hidden // 3 // 64) * 64,
        residual=residual,
        kda_num_heads=num_heads,
        kda_head_dim=head_dim,
        kda_gate="head" if model == "gdn" else "bounded",
        mla_num_heads=num_heads,
        mla_kv_lora_rank=hidden,
        mla_qk_nope_head_dim=head_dim - shared,
        mla_qk_shared_head_dim=shared,
        mla_v_head_dim=head_dim,
    )
