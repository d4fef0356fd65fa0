"""Paged MLA decode on a CUDA GPU at k3-scaled sizes: bf16 against the float64 decompressed reference, pages of the
serving engine's size (64 rows) shuffled in a pool, long and mixed contexts, and CUDA-graph capture with the page
table and lengths changing between replays."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.ops.mla.test_decode_gpu import K3, make_problem
from tests.helpers import assert_close, needs_cuda
from tests.ops.mla.cases import decompressed_reference, up_project
from tests.ops.mla.test_paged import page_out

pytestmark = needs_cuda


def paged(p, page_size, **kw):
    from hybrid_attention.ops.mla.paged import paged_mla_decode

    pool, table = page_out(p["rows"].cpu(), page_size, seed=1)
    return paged_mla_decode(
        p["q"], pool.cuda(), table.cuda(), p["seq_lens"], value_dim=p["d_c"], scale=p["scale"], **kw
    )


@pytest.mark.parametrize("lens,Tq", [([1], 1), ([1000], 1), ([1000], 4), ([70000], 1), ([1, 2, 1000, 4097, 33], 1)])
@pytest.mark.parametrize("page_size", [16, 64])
def test_bf16_paged_matches_decompressed_reference(lens, Tq, page_size):
    p = make_problem(lens, Tq, seed=sum(lens) + Tq)
    ref = decompressed_reference(p)
    for ns in (None, 1, 7):
        o = paged(p, page_size, num_splits=ns)
        assert o.dtype == torch.bfloat16 and o.shape == (len(lens), Tq, K3["H"], K3["d_c"])
        assert_close(f"paged bf16 lens={lens} Tq={Tq} page={page_size} splits={ns}", up_project(p, o), ref, 1e-2)


def test_graph_replay_follows_the_table_and_lengths():
    from hybrid_attention.ops.mla.paged import paged_mla_decode

    p = make_problem([3000, 700], 1, seed=5)
    pool, table = page_out(p["rows"].cpu(), 64, seed=2)
    pool, table = pool.cuda(), table.cuda()
    lens = torch.tensor([1, 1], dtype=torch.int32, device="cuda")
    run = lambda: paged_mla_decode(p["q"], pool, table, lens, value_dim=p["d_c"], scale=p["scale"])  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for new in ([3000, 700], [17, 699], [2048, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        p["seq_lens"] = lens.clone()
        assert_close(f"replay lens={new}", up_project(p, out), decompressed_reference(p), 1e-2)
