"""Gated MLA ops: the readable absorbed attention over latent rows, the split-context decode kernel, and the chunked
prefill in the decompressed form with its readable reference and prefix readers."""

from hybrid_attention.ops.mla.decode import mla_decode, naive_mla_decode
from hybrid_attention.ops.mla.naive import bottom_right_causal_mask, naive_absorbed_attention
from hybrid_attention.ops.mla.naive_prefill import naive_mla_prefill
from hybrid_attention.ops.mla.prefill import mla_prefill
from hybrid_attention.ops.mla.prefix import contiguous_prefix, paged_prefix

__all__ = [
    "bottom_right_causal_mask",
    "contiguous_prefix",
    "mla_decode",
    "mla_prefill",
    "naive_absorbed_attention",
    "naive_mla_decode",
    "naive_mla_prefill",
    "paged_prefix",
]
