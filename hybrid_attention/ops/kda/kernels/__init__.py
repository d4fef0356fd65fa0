"""The Triton kernels of chunkwise KDA, one stage per file; the host drivers that launch them are chunk_fwd.py and
chunk_bwd.py (the decode step's kernel lives with its launcher in triton_step.py)."""
