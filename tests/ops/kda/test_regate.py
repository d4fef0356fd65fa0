"""The KDA backward computes W, qg and kg again (kernels/regate.py) instead of keeping them from the forward: the
recomputed tiles equal the forward's, bit for bit under the Triton interpreter (on a GPU up to float32 rounding: the
two kernels' cumulative sums may be laid out differently), with and without the fused gate and l2norm, packed
sequences, and a chunk with a bad row (the checked path's masks: W zero and qg NaN from that row on); and training
keeps no [H, T, K] tensor."""

from __future__ import annotations

import pytest
import torch

import hybrid_attention.ops.kda.chunk_fwd as chunk_fwd
from hybrid_attention.ops.kda.chunk_bwd import regate
from hybrid_attention.ops.kda.gate import FORM_CODES
from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton
from hybrid_attention.ops.kda.triton_utils import ChunkLayout, dot_setup
from tests.helpers import DEV
from tests.ops.kda.cases import make_inputs

if not torch.cuda.is_available():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it; without it the kernels cannot run on CPU
        pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

GATED = ("w", "qg", "kg")
RTOL = 0.0 if DEV == "cpu" else 1e-6  # float32 inputs


def _assert_same(name, a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=0.0, equal_nan=True, msg=name)


def _forward_and_regate(inputs, *, form, l2norm, cu_seqlens, monkeypatch):
    """The forward's W, qg, kg (kept by lifting them out of the scratch) and the backward's recomputed ones."""
    monkeypatch.setattr(chunk_fwd, "SCRATCH", ("u",))
    q, k, v, g, beta, h0, a_log, dt_bias = inputs
    B, T, H, K = q.shape
    gate = FORM_CODES[form]
    none = torch.empty(0, device=DEV)
    dt = dt_bias.reshape(H, K) if gate else none
    a_log = a_log if gate else none
    scale, lower_bound = K**-0.5, -5.0
    _, _, saved = chunk_fwd.kda_fwd(q, k, v, g, beta, a_log, dt, h0 if cu_seqlens is None else None, cu_seqlens,
                                    scale=scale, lower_bound=lower_bound, gate=gate, l2norm=l2norm, final=False,
                                    save=True)  # fmt: skip
    flat = [x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, g)]
    prec, emu, a32 = dot_setup(v.dtype)
    io = chunk_fwd.TL_DTYPES[v.dtype]
    dtypes = (io, io, prec, emu)
    layout = ChunkLayout(B, T, q.device, cu_seqlens)
    again = regate(*flat, beta.reshape(B * T, H).contiguous(), a_log, dt, saved, layout, scale=scale,
                   lower_bound=lower_bound, gate=gate, l2norm=l2norm, io=v.dtype, dtypes=dtypes)  # fmt: skip
    return [saved[name] for name in GATED], again


@pytest.mark.parametrize(
    "form, l2norm, packed",
    [(None, False, False), ("bounded", True, False), ("softplus", True, True)],
    ids=["plain", "bounded-l2norm", "softplus-l2norm-packed"],
)
def test_recomputed_tiles_equal_the_forward(form, l2norm, packed, monkeypatch):
    B, cu = (1, torch.tensor([0, 61, 150], device=DEV)) if packed else (2, None)
    inputs = make_inputs(B, 150 if packed else 75, 2, 16, 24, N=2 if packed else None, gate=form or False,
                         l2norm=l2norm, seed=71)  # fmt: skip
    ours, again = _forward_and_regate(inputs, form=form, l2norm=l2norm, cu_seqlens=cu, monkeypatch=monkeypatch)
    for name, a, b in zip(GATED, ours, again, strict=True):
        _assert_same(name, a, b)


def test_a_bad_row_is_masked_as_the_forward_masked_it(monkeypatch):
    inputs = make_inputs(1, 130, 1, 16, 16, seed=72)
    inputs[1][0, 70, 0, 3] = float("nan")  # a bad k in chunk 1, row 6: the checked path masks rows 6 .. 63 there
    ours, again = _forward_and_regate(inputs, form=None, l2norm=False, cu_seqlens=None, monkeypatch=monkeypatch)
    w, qg = ours[0][0], ours[1][0]
    assert torch.isnan(qg[70:128]).all() and not torch.isnan(qg[:70]).any(), "the forward's masks, as documented"
    assert (w[70:128] == 0).all()
    for name, a, b in zip(GATED, ours, again, strict=True):
        _assert_same(name, a, b)


def test_training_keeps_no_gated_tiles():
    """What autograd keeps for the backward of the op: no [H, T, K] tensor (K = 16 differs from V = 24 here)."""
    q, k, v, g, beta, h0, _, _ = make_inputs(1, 70, 2, 16, 24, seed=73)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        o, _ = chunk_kda_triton(*leaves, initial_state=h0)
    assert shapes, "nothing saved: the op did not run with gradients"
    assert (2, 70, 16) not in shapes, shapes
    o.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
