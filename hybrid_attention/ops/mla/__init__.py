"""Gated MLA ops: the readable absorbed attention over latent rows, and the split-context decode kernel."""

from hybrid_attention.ops.mla.decode import mla_decode, naive_mla_decode
from hybrid_attention.ops.mla.naive import bottom_right_causal_mask, naive_absorbed_attention

__all__ = ["naive_absorbed_attention", "bottom_right_causal_mask", "mla_decode", "naive_mla_decode"]
