"""hybrid-attention: Kimi Delta Attention, Gated MLA (NoPE) and Attention Residuals, end to end."""

__version__ = "0.1.0"
