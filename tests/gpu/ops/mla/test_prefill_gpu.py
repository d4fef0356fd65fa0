"""Chunked MLA prefill on a CUDA GPU at k3-scaled sizes (H=8, d_n=96, d_s=32, d_c=256, d_v=128): every attention
kernel's output and log-sum-exp against float64 (every config of the Triton one), which kernel "auto" picks,
`mla_prefill` over a 70000-token prefix against the float64 reference (every kernel, tiles that do not divide the
prefix, batch 2), the paged reader, and the workspace of a long prefix (tiles, never the whole prefix
decompressed)."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.backends import use_reference
from hybrid_attention.ops.mla.lse_attention import _failed, attention_with_lse, pick_kernel
from hybrid_attention.ops.mla.naive_prefill import naive_mla_prefill
from hybrid_attention.ops.mla.prefill import TILE_BYTES, mla_prefill
from hybrid_attention.ops.mla.prefix import contiguous_prefix, paged_prefix
from tests.helpers import assert_close, needs_cuda

pytestmark = needs_cuda
H, D_N, D_S, D_C, D_V = 8, 96, 32, 256, 128
KERNELS = ["cudnn", "flash", "efficient", "triton", "math"]


def hopper() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def randn(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "Tq,Tk,causal", [(2048, 2048, True), (1024, 3072, False), (1000, 3001, False), (777, 777, True)]
)
def test_attention_with_lse_kernels(kernel, Tq, Tk, causal):
    if kernel == "cudnn" and not hopper():
        pytest.skip("cuDNN is the kernel of choice on Hopper only")
    q = randn(2, H, Tq, 128, seed=1, scale=2.0)  # peaked rows, so that a wrong LSE shows
    k, v = randn(2, H, Tk, 128, seed=2), randn(2, H, Tk, 128, seed=3)
    o, lse = attention_with_lse(q, k, v, scale=128**-0.5, causal=causal, kernel=kernel)
    assert o.shape == (2, H, Tq, 128) and o.dtype == torch.bfloat16
    assert lse.shape == (2, H, Tq) and lse.dtype == torch.float32
    scores = q.double() @ k.double().transpose(-1, -2) * 128**-0.5
    if causal:
        scores = scores.masked_fill(torch.ones(Tq, Tk, device="cuda").triu(1).bool(), float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    assert_close(f"{kernel} lse", lse, ref_lse, 1e-4)
    assert_close(f"{kernel} o", o, torch.exp(scores - ref_lse[..., None]) @ v.double(), 1e-2)


@pytest.mark.parametrize("index", range(4))
def test_every_triton_config(index, monkeypatch):
    from hybrid_attention.ops.mla.kernels.attention_lse import _attention_lse_kernel as tuner

    monkeypatch.setattr(tuner, "configs", [tuner.all_configs[index]])
    for Tq, Tk, causal in [(1000, 1000, True), (777, 3001, False)]:
        q, k, v = (
            randn(2, H, Tq, 128, seed=index, scale=2.0),
            randn(2, H, Tk, 128, seed=9),
            randn(2, H, Tk, 128, seed=8),
        )
        o, lse = attention_with_lse(q, k, v, scale=128**-0.5, causal=causal, kernel="triton")
        ref_o, ref_lse = attention_with_lse(q.double(), k.double(), v.double(), scale=128**-0.5, causal=causal)
        assert_close(f"config {index} o", o, ref_o, 1e-2)
        assert_close(f"config {index} lse", lse, ref_lse, 1e-4)


def test_auto_kernel_choice():
    q, k = randn(1, H, 4096, 128, seed=4), randn(1, H, 8192, 128, seed=5)
    assert pick_kernel(q, k, k) == ("cudnn" if hopper() else "flash")
    assert pick_kernel(q[:, :, :1000], k, k) == "flash"  # a one-off length: no cuDNN plan for it
    assert pick_kernel(q.float(), k.float(), k.float()) == "efficient"
    assert pick_kernel(q.double(), k.double(), k.double()) == "math"  # no fused kernel takes float64
    wide = q.expand(32, -1, -1, -1)  # 32 sequences x 8 heads: more rows than cuDNN is given
    assert pick_kernel(wide, k.expand(32, -1, -1, -1), k.expand(32, -1, -1, -1)) == "flash"
    assert pick_kernel(q.requires_grad_(), k, k) == "math"  # a merge needs the LSE's gradient
    with use_reference():
        assert pick_kernel(k, k, k) == "math"


def make_problem(B, P, C, seed):
    return dict(
        q=randn(B, C, H, D_N + D_S, seed=seed, scale=1.5),
        rows=randn(B, P + C, D_C + D_S, seed=seed + 1),
        w_uk=randn(H, D_N, D_C, seed=seed + 2, scale=D_C**-0.5),
        w_uv=randn(H, D_V, D_C, seed=seed + 3, scale=D_C**-0.5),
        P=P,
    )


def run(p, reader=None, **kw):
    P = p["P"]
    reader = reader or contiguous_prefix(p["rows"])
    scale = (D_N + D_S) ** -0.5
    return mla_prefill(p["q"], p["rows"][:, P:], p["w_uk"], p["w_uv"], scale=scale, prefix=reader, prefix_len=P, **kw)


def reference(p, block=512):
    """float64, in blocks of queries: block [i, j) sees the prefix and chunk rows before i as its prefix."""
    P, C = p["P"], p["q"].shape[1]
    outs = []
    for i in range(0, C, block):
        j = min(C, i + block)
        q, prefix, rows = p["q"][:, i:j], p["rows"][:, : P + i], p["rows"][:, P + i : P + j]
        outs.append(naive_mla_prefill(q, prefix, rows, p["w_uk"], p["w_uv"], scale=(D_N + D_S) ** -0.5).double())
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kernel", ["auto", *KERNELS])
def test_mla_prefill_over_a_long_prefix(kernel):
    if kernel == "cudnn" and not hopper():
        pytest.skip("cuDNN is the kernel of choice on Hopper only")
    p = make_problem(1, 70000, 4096, seed=10)
    ref = reference(p)
    for tile in (None, 32768, 5000):
        out = run(p, tile_size=tile, kernel=kernel)
        assert out.shape == (1, 4096, H, D_V) and out.dtype == torch.bfloat16
        assert_close(f"{kernel} tile={tile}", out, ref, 1e-2)
    assert not _failed, f"kernels that raised: {_failed}"


def test_batch_and_paged_prefix():
    """Batch 2, pages of 64 rows in a shuffled pool: the tiles are the contiguous rows, the result the reference."""
    B, P, C, page = 2, 9000, 1024, 64
    p = make_problem(B, P, C, seed=20)
    n = -(-(P + C) // page)
    pool = torch.full((B * n + 5, page, D_C + D_S), float("nan"), device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pool.shape[0], device="cuda")[: B * n].view(B, n).int()
    padded = torch.nn.functional.pad(p["rows"], (0, 0, 0, n * page - P - C))
    pool[table.flatten().long()] = padded.reshape(B * n, page, -1)
    reader = paged_prefix(pool, table)
    for start, stop in [(0, 4096), (4000, 9000), (8191, 8193)]:
        assert torch.equal(reader(start, stop), p["rows"][:, start:stop])
    ref = reference(p)
    assert_close("contiguous", run(p), ref, 1e-2)
    assert_close("paged", run(p, reader=reader, tile_size=4000), ref, 1e-2)


def test_workspace_stays_bounded():
    """A 256K-token prefix: what the call allocates beyond its inputs stays about one tile of keys and values,
    a fraction of the whole prefix decompressed (8 heads x 256 numbers per token)."""
    p = make_problem(1, 1 << 18, 4096, seed=30)
    run(p)  # plans and libraries outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run(p)
    workspace = torch.cuda.max_memory_allocated() - base
    whole = (1 << 18) * H * (D_N + D_S + D_V) * 2
    assert workspace <= TILE_BYTES + (128 << 20), f"{workspace / 2**20:.0f} MiB"
    assert workspace < whole, (workspace, whole)
