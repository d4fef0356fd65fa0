"""Kimi Delta Attention ops: the recurrent reference, the chunkwise op with backend dispatch, the decode step and the
gate; shapes, dtypes and backends in docs/kernels.md, "The KDA ops".
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
