"""The fused AttnRes + RMSNorm kernel (`ops.attnres.fused`) on CUDA at k3-scaled widths, at decode (1 row) and
prefill (4096 rows) sizes, which take different launch shapes (all sources in one tile, or 8 at a time with an
online softmax): as accurate against float64 as the bf16 PyTorch composition. Run:
`python -m pytest -q tests/gpu/test_attnres_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.attnres.fused import attn_res_norm
from tests.helpers import assert_as_accurate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 4096])
@pytest.mark.parametrize("S", [1, 14, 27])
def test_fused_attn_res_norm_at_model_widths(rows, S):
    D = 1024
    g = torch.Generator("cuda").manual_seed(S * rows)
    buf = torch.full((S + 2, 1, rows, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    scales = torch.rand(S, 1, 1, 1, device="cuda", generator=g) * 4 + 0.1
    buf[:S] = (torch.randn(S, 1, rows, D, device="cuda", generator=g) * scales).bfloat16()
    latest = buf[S - 1].clone()
    buf[S - 1] = float("nan")  # must come from `latest`
    query = torch.randn(D, device="cuda", generator=g) * 2 * D**-0.5
    key_w, norm_w = (0.5 + torch.rand(D, device="cuda", generator=g) for _ in range(2))
    args = dict(norm_weight=norm_w, norm_eps=1e-6)
    out = attn_res_norm(buf[:S], query, key_w, 1e-6, latest=latest, backend="triton", **args)
    assert torch.equal(buf[S - 1], latest) and torch.isnan(buf[S:]).all()
    src64 = buf[:S].double()
    ref = attn_res_norm(
        src64,
        query.double(),
        key_w.double(),
        1e-6,
        backend="torch",
        **{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in args.items()},
    )
    plain = attn_res_norm(buf[:S].clone(), query, key_w, 1e-6, backend="torch", **args)
    assert_as_accurate(f"attn_res_norm rows={rows} S={S}", out, ref, plain, floor=2**-8)
