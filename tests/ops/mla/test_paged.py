"""Absorbed MLA attention over a paged latent cache (`paged_mla_decode`: the Triton kernel under the interpreter on
CPU, and the gather reference), the eager page write, and the fused one-token append through a page table."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.mla.decode import naive_mla_decode
from hybrid_attention.ops.mla.paged import gather_pages, naive_paged_mla_decode, paged_mla_decode, write_paged_rows
from tests.helpers import DEV, assert_close, needs_triton
from tests.ops.mla.cases import decompressed_reference, make_problem, up_project

TINY = dict(d_c=32, d_s=16, H=2, d_n=24, d_v=16)


def page_out(rows: torch.Tensor, page_size: int, *, seed: int = 0, spare: int = 3):
    """Scatter contiguous rows [B, N, D] into a pool of shuffled pages (unused pages and rows NaN): (pool, table)."""
    B, N, D = rows.shape
    per_seq = -(-N // page_size)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(B * per_seq + spare, generator=g)[: B * per_seq]
    table = order.view(B, per_seq).to(torch.int32)
    pool = torch.full((B * per_seq + spare, page_size, D), float("nan"), dtype=rows.dtype)
    padded = torch.full((B, per_seq * page_size, D), float("nan"), dtype=rows.dtype)
    padded[:, :N] = rows
    pool[table.long().flatten()] = padded.view(B * per_seq, page_size, D)
    return pool, table


CASES = [([1], 1, 16), ([37], 1, 16), ([37], 3, 8), ([200], 1, 64), ([3, 37, 200, 64], 3, 16), ([5, 70, 1], 1, 7)]


@pytest.mark.parametrize("lens,Tq,page_size", CASES)
def test_reference_equals_contiguous_decode(lens, Tq, page_size):
    p = make_problem(lens, Tq, **TINY, seed=sum(lens) + Tq)
    pool, table = page_out(p["rows"].double(), page_size, seed=Tq)
    o = naive_paged_mla_decode(p["q64"], pool, table, p["seq_lens"], value_dim=p["d_c"], scale=p["scale"])
    ref = naive_mla_decode(p["q64"], p["rows"].double(), p["seq_lens"], value_dim=p["d_c"], scale=p["scale"])
    assert_close(f"paged reference {lens} Tq={Tq} page={page_size}", o, ref, 1e-12)
    assert_close("against decompressed", up_project(p, o), decompressed_reference(p), 1e-10)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("lens,Tq,page_size", CASES)
def test_triton_matches_reference(lens, Tq, page_size, num_splits):
    p = make_problem(lens, Tq, **TINY, seed=3 * sum(lens) + Tq)
    pool, table = page_out(p["rows"], page_size, seed=len(lens))
    args = (p["q"].to(DEV), pool.to(DEV), table.to(DEV), p["seq_lens"].to(DEV))
    o = paged_mla_decode(*args, value_dim=p["d_c"], scale=p["scale"], num_splits=num_splits, backend="triton")
    assert o.shape == (len(lens), Tq, TINY["H"], TINY["d_c"])
    assert_close(f"paged triton {lens} Tq={Tq} page={page_size}", up_project(p, o), decompressed_reference(p), 1e-5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_pages_past_the_length_are_never_read(backend):
    """Garbage in a sequence's unused rows and pages, and in pages of nobody, leaves the output unchanged."""
    p = make_problem([5, 40], 1, **TINY, max_len=48, seed=8, poison=0.0)
    pool, table = page_out(p["rows"], 16)
    outs = []
    for poison in (0.0, float("nan"), -3e38):
        dirty = pool.clone()
        for b, L in enumerate([5, 40]):
            flat = dirty[table[b].long()].view(-1, pool.shape[2])
            flat[L:] = poison
            dirty[table[b].long()] = flat.view(-1, 16, pool.shape[2])
        args = (p["q"].to(DEV), dirty.to(DEV), table.to(DEV), p["seq_lens"].to(DEV))
        outs.append(paged_mla_decode(*args, value_dim=p["d_c"], scale=p["scale"], num_splits=2, backend=backend))
    assert torch.isfinite(outs[0]).all()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_write_paged_rows_lands_where_gather_reads():
    B, D, page_size = 3, 6, 4
    lengths = torch.tensor([3, 9, 12], dtype=torch.int32)  # already counting the 3 new tokens
    pool, table = page_out(torch.zeros(B, 12, D), page_size)
    new = torch.randn(B, 3, D)
    write_paged_rows(pool, table, lengths, new)
    rows = gather_pages(pool, table)
    for b, L in enumerate(lengths.tolist()):
        assert torch.equal(rows[b, L - 3 : L], new[b])
        assert torch.equal(rows[b, : L - 3], torch.zeros(L - 3, D))


@needs_triton
def test_fused_append_through_a_page_table_equals_the_eager_write():
    from hybrid_attention.ops.mla.append import append_latent_row

    B, d_c, d_s, page_size = 3, 32, 16, 8
    g = torch.Generator().manual_seed(1)
    kv, ks = torch.randn(B, 1, d_c, generator=g), torch.randn(B, 1, d_s, generator=g)
    weight, eps = torch.rand(d_c, generator=g) + 0.5, 1e-6
    lengths = torch.tensor([1, 9, 24], dtype=torch.int32)
    pool, table = page_out(torch.zeros(B, 24, d_c + d_s), page_size)
    fused = pool.clone().to(DEV)
    append_latent_row(kv.to(DEV), ks.to(DEV), weight.to(DEV), eps, fused, lengths.to(DEV), page_table=table.to(DEV))
    c = kv * torch.rsqrt(kv.pow(2).mean(-1, keepdim=True) + eps) * weight
    write_paged_rows(pool, table, lengths, torch.cat([c, ks], dim=-1))
    assert_close("fused paged append", gather_pages(fused.cpu(), table), gather_pages(pool, table).nan_to_num(), 1e-6)


def test_bad_inputs_raise():
    p = make_problem([10], 1, **TINY)
    pool, table = page_out(p["rows"], 4)
    kw = dict(value_dim=p["d_c"], scale=p["scale"], backend="torch")
    with pytest.raises(ValueError, match="page_table must be an int32"):
        paged_mla_decode(p["q"], pool, table.long(), p["seq_lens"], **kw)
    with pytest.raises(ValueError, match="seq_lens must lie"):
        paged_mla_decode(p["q"], pool, table, torch.tensor([99], dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_mla_decode(p["q"], pool, table + 100, p["seq_lens"], **kw)
    with pytest.raises(ValueError, match="pool must be"):
        paged_mla_decode(p["q"], pool[..., :5], table, p["seq_lens"], **kw)
