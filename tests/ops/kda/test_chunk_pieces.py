"""A long prompt fed to `chunk_kda` in pieces (each piece's final state the next one's initial state) equals one
call: KDA prefill stays linear in the prompt and exact across prefill chunks. float64 reference backend, and the
Triton kernels in float32 (the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.kda import chunk_kda
from tests.helpers import DEV, assert_close, needs_triton
from tests.ops.kda.cases import make_inputs


def in_pieces(inputs, pieces, **kw):
    q, k, v, g, beta, h0, A_log, dt_bias = inputs
    outs, state, start = [], h0, 0
    gate = dict(gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm=True)
    for n in pieces:
        part = (x[:, start : start + n] for x in (q, k, v, g, beta))
        o, state = chunk_kda(*part, initial_state=state, output_final_state=True, **gate, **kw)
        outs.append(o)
        start += n
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("pieces", [[130], [1, 63, 66], [50, 17, 1, 62]])
def test_reference_backend_in_pieces_equals_one_call(pieces):
    inputs = make_inputs(1, sum(pieces), 2, 16, 16, gate=True, l2norm=True, dtype=torch.float64, seed=len(pieces))
    inputs[5] = inputs[5].double()
    whole_o, whole_s = in_pieces(inputs, [sum(pieces)], backend="torch")
    o, s = in_pieces(inputs, pieces, backend="torch")
    assert_close("output", o, whole_o, 1e-12)
    assert_close("final state", s, whole_s, 1e-12)


@needs_triton
def test_triton_in_pieces_equals_one_call():
    inputs = make_inputs(1, 100, 2, 16, 16, gate=True, l2norm=True, seed=5, device=DEV)
    whole_o, whole_s = in_pieces(inputs, [100], backend="triton")
    o, s = in_pieces(inputs, [37, 63], backend="triton")
    assert_close("output", o, whole_o, 1e-5)
    assert_close("final state", s, whole_s, 1e-5)
