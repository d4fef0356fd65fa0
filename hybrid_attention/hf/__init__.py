"""Hugging Face transformers integration (the optional `hf` extra: `pip install 'hybrid-attention[hf]'`).

- `HybridAttentionConfig`, `HybridAttentionForCausalLM`: `HybridLM` as a transformers model, registered with
  `AutoConfig` and `AutoModelForCausalLM` on import (model type "hybrid_attention");
- `HybridAttentionCache`: the transformers `Cache` that generation uses (KDA states and MLA latent rows);
- `convert`: transformers' own Kimi Linear and GLM-5-next attention layers as ours, on the same weights;
- `export_run`: a training run directory as a transformers model directory, tokenizer included.

The core package never imports transformers; only this subpackage does.
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
