"""Gated MLA ops: the readable absorbed attention over latent rows, and the split-context decode kernel."""

from hybrid_attention.ops.mla.decode import mla_decode, mla_decode_torch
from hybrid_attention.ops.mla.naive import absorbed_attention, bottom_right_causal_mask

__all__ = ["absorbed_attention", "bottom_right_causal_mask", "mla_decode", "mla_decode_torch"]
