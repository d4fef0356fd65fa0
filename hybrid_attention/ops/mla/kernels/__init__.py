"""The Triton kernels of the MLA flash decode, one stage per file; triton_decode.py plans and launches them."""
