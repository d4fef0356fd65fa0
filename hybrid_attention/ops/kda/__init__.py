"""Kimi Delta Attention ops: the recurrent ground truth, the chunkwise op with backend dispatch, and the gate.

    o, S = recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None)
    o, S = chunk_kda(q, k, v, g, beta, ..., chunk_size=64, backend="auto")
    o, S = chunk_kda(q, k, v, z, beta, gate="bounded" | "softplus", A_log=A_log, dt_bias=dt_bias, ...)
    o, S, states = chunk_kda(..., return_chunk_states=True)      # the state at the start of every chunk
    o = kda_decode_step(q, k, v, g, beta, pool, state_indices=idx)   # decode with a pool of states, in place
    g = kda_gate(z, A_log, dt_bias, lower_bound=None, form="bounded" | "softplus" | "head")

Backends of `chunk_kda`: "torch" (readable reference, naive.py), "triton" (our kernels, triton_chunk.py),
"fla" (flash-linear-attention 0.6.0, optional extra), "auto" (see `resolve_backend`). Every op takes more value
heads than query/key heads (value_heads.py) and `chunk_kda` and the decode step take beta as logits
(`use_beta_sigmoid`).
"""

from hybrid_attention.choices import GATE_FORMS
from hybrid_attention.ops.kda.chunk import BACKENDS, chunk_kda, resolve_backend
from hybrid_attention.ops.kda.common import l2_normalize, validate_kda_inputs
from hybrid_attention.ops.kda.decode_step import kda_decode_step
from hybrid_attention.ops.kda.gate import kda_gate
from hybrid_attention.ops.kda.recurrent import recurrent_kda

__all__ = [
    "BACKENDS",
    "GATE_FORMS",
    "chunk_kda",
    "kda_decode_step",
    "kda_gate",
    "l2_normalize",
    "recurrent_kda",
    "resolve_backend",
    "validate_kda_inputs",
]
