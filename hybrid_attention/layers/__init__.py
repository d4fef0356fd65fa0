"""nn.Modules that own parameters: the KDA and Gated MLA mixers, Attention Residuals and the small pieces."""

from hybrid_attention.layers.attnres import AttnRes
from hybrid_attention.layers.conv import ShortConv
from hybrid_attention.layers.kda import KDACache, KimiDeltaAttention
from hybrid_attention.layers.mla import GatedMLA, MLACache
from hybrid_attention.layers.mlp import SwiGLU
from hybrid_attention.layers.norm import GatedRMSNorm, RMSNorm

__all__ = [
    "AttnRes",
    "GatedMLA",
    "GatedRMSNorm",
    "KDACache",
    "KimiDeltaAttention",
    "MLACache",
    "RMSNorm",
    "ShortConv",
    "SwiGLU",
]
