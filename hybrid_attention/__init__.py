"""hybrid-attention: Kimi Delta Attention, Gated MLA (NoPE) and Attention Residuals, end to end.

The main names (`HybridConfig`, `HybridLM`, `chunk_kda`, `KimiDeltaAttention`, `GatedMLA`, `AttnRes`, ...) import from
the top level and load on first use, so `import hybrid_attention` stays cheap (the CLI reads the version before torch).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "HybridConfig": "hybrid_attention.config",
    "HybridLM": "hybrid_attention.model",
    "HybridCache": "hybrid_attention.cache",
    "chunk_kda": "hybrid_attention.ops.kda",
    "recurrent_kda": "hybrid_attention.ops.kda",
    "kda_gate": "hybrid_attention.ops.kda",
    "naive_attn_res": "hybrid_attention.ops.attnres.naive",
    "KimiDeltaAttention": "hybrid_attention.layers",
    "GatedMLA": "hybrid_attention.layers",
    "AttnRes": "hybrid_attention.layers",
    "SwiGLU": "hybrid_attention.layers",
    "RMSNorm": "hybrid_attention.layers",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybrid_attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
