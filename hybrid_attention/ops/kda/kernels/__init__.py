"""The Triton kernels of chunkwise and recurrent KDA, one stage per file; the host drivers that launch them
are chunk_fwd.py, chunk_bwd.py and triton_recurrent.py."""
