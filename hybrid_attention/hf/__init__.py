"""Hugging Face transformers integration (the optional `hf` extra): `HybridLM` as a transformers model and cache,
registered with the Auto classes on import; the core package never imports transformers (docs/transformers.md).
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("hybrid_attention.hf needs the `transformers` package: pip install 'hybrid-attention[hf]'") from e

from transformers import AutoConfig, AutoModelForCausalLM

from hybrid_attention.hf.cache import HybridAttentionCache
from hybrid_attention.hf.configuration import HybridAttentionConfig
from hybrid_attention.hf.modeling import HybridAttentionForCausalLM

AutoConfig.register(HybridAttentionConfig.model_type, HybridAttentionConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridAttentionConfig, HybridAttentionForCausalLM, exist_ok=True)

__all__ = ["HybridAttentionCache", "HybridAttentionConfig", "HybridAttentionForCausalLM"]
