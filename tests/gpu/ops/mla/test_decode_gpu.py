"""Absorbed MLA decode on a CUDA GPU at k3-scaled sizes (H=8, d_c=256, d_s=32, d_n=96, d_v=128).

bf16/fp16 inputs against a float64 reference over the decompressed cache (per-head K_h = [W_UK,h c ; k_s],
V_h = W_UV,h c), contexts 1 to 70000, mixed lengths, NaN past every length, several split counts, fp32 inputs
(no tf32 allowed), and CUDA-graph capture with seq_lens changing between replays.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, needs_cuda
from tests.ops.mla import cases as mla_cases
from tests.ops.mla.cases import decompressed_reference, up_project

pytestmark = needs_cuda

K3 = dict(d_c=256, d_s=32, H=8, d_n=96, d_v=128)


def make_problem(lens, Tq, *, dtype=torch.bfloat16, **kw):
    """A problem on the GPU at k3-scaled sizes, a whole 64-row block of NaN past the longest sequence, heads of
    different sharpness."""
    return mla_cases.make_problem(lens, Tq, **K3, dtype=dtype, device="cuda", spare=64, sharpen_heads=True, **kw)


def decode(p, **kw):
    from hybrid_attention.ops.mla.decode import mla_decode

    return mla_decode(p["q"], p["rows"], p["seq_lens"], value_dim=p["d_c"], scale=p["scale"], **kw)


@pytest.mark.parametrize(
    "lens,Tq",
    [([1], 1), ([2], 1), ([2], 2), ([1000], 1), ([1000], 4), ([70000], 1), ([70000], 4)]
    + [([1, 2, 1000, 70000, 4097], 1)],
)
def test_bf16_matches_decompressed_reference(lens, Tq):
    p = make_problem(lens, Tq, seed=sum(lens) + Tq)
    ref = decompressed_reference(p)
    for ns in (None, 1, 7):
        o = decode(p, num_splits=ns)
        assert o.dtype == torch.bfloat16 and o.shape == (len(lens), Tq, K3["H"], K3["d_c"])
        assert_close(f"bf16 lens={lens} Tq={Tq} splits={ns}", up_project(p, o), ref, 1e-2)


def test_mixed_lengths_multi_token():
    lens = [4, 17, 999, 5000, 33, 70000]
    p = make_problem(lens, 3, max_len=72000, seed=1)
    assert_close("bf16 mixed Tq=3", up_project(p, decode(p)), decompressed_reference(p), 1e-2)


def test_fp16():
    p = make_problem([1000, 3], 2, dtype=torch.float16, seed=2)
    o = decode(p)
    assert o.dtype == torch.float16
    assert_close("fp16", up_project(p, o), decompressed_reference(p), 1e-2)


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_fp32_is_exact(num_splits):
    """fp32 inputs take the IEEE dot path: a tf32 rounding would show up as ~1e-3 error."""
    p = make_problem([1000, 3, 2500], 2, dtype=torch.float32, seed=3)
    o = decode(p, num_splits=num_splits)
    assert_close(f"fp32 splits={num_splits}", up_project(p, o), decompressed_reference(p), 1e-5)


def test_triton_agrees_with_torch_path():
    p = make_problem([2, 1500, 300], 2, seed=4)
    o = decode(p)
    o_torch = decode(p, backend="torch")
    assert_close("triton vs torch", o.float(), o_torch.float(), 1e-2)


def test_cuda_graph_with_changing_lengths():
    """Capture once over a static cache, then replay with new lengths and contents: no recapture, no host sync."""
    from hybrid_attention.ops.mla.decode import mla_decode

    B, Tq, max_len = 3, 2, 4096
    p = make_problem([max_len] * B, Tq, max_len=max_len, seed=5)
    q, rows, lens = p["q"].clone(), p["rows"].clone(), p["seq_lens"].clone()  # static buffers
    kw = dict(value_dim=p["d_c"], scale=p["scale"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            mla_decode(q, rows, lens, **kw)  # compile and load the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q, rows, lens, **kw)

    for i, new_lens in enumerate([[2, max_len, 777], [max_len, 3, 1500], [100, 64, 2]]):
        fresh = make_problem(new_lens, Tq, max_len=max_len, seed=100 + i)
        fresh["w_uk"], fresh["w_uv"] = p["w_uk"], p["w_uv"]
        q.copy_(torch.cat([torch.einsum("bthn,hnc->bthc", fresh["q_n"], p["w_uk"]), fresh["q_s"]], -1))
        fresh["q"] = q
        rows.copy_(fresh["rows"])  # NaN past the new lengths
        lens.copy_(fresh["seq_lens"])
        graph.replay()
        torch.cuda.synchronize()
        fresh["rows"], fresh["seq_lens"] = rows, lens
        assert_close(f"graph replay {new_lens}", up_project(fresh, out), decompressed_reference(fresh), 1e-2)
        assert torch.equal(out, mla_decode(q, rows, lens, **kw)), "replay differs from an eager call"
