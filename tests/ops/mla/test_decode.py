"""Absorbed MLA decode (`mla_decode`, Triton kernel under the interpreter on CPU, and `naive_mla_decode`).

The reference decompresses the cache per head (K_h = [W_UK,h c ; k_s], V_h = W_UV,h c, float64 softmax); the
kernel's latent output goes through W_UV,h before comparing, so these tests check absorption end to end too.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.mla.decode import mla_decode, naive_mla_decode
from tests.helpers import DEV, assert_close, needs_triton
from tests.ops.mla.cases import decompressed_reference, make_problem, up_project

triton = pytest.importorskip("triton")
from hybrid_attention.ops.mla.triton_decode import default_num_splits, mla_decode_triton  # noqa: E402
from hybrid_attention.ops.triton_support import interpreting  # noqa: E402

TINY = dict(d_c=32, d_s=16, H=2, d_n=24, d_v=16)


def run(p, *, backend="triton", num_splits=None, dtype=torch.float32):
    q, rows, lens = (p[k].to(DEV) for k in ("q", "rows", "seq_lens"))
    return mla_decode(
        q.to(dtype), rows.to(dtype), lens, value_dim=p["d_c"], scale=p["scale"], num_splits=num_splits, backend=backend
    )


CASES = [([1], 1), ([2], 1), ([2], 2), ([37], 1), ([37], 3), ([200], 1), ([200], 3), ([3, 37, 200, 64], 3)]


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 4, None])
@pytest.mark.parametrize("lens,Tq", CASES)
def test_triton_matches_decompressed_reference(lens, Tq, num_splits):
    p = make_problem(lens, Tq, **TINY, seed=len(lens) * 1000 + lens[-1] * 10 + Tq)
    o = run(p, num_splits=num_splits)
    assert o.shape == (len(lens), Tq, TINY["H"], TINY["d_c"]) and o.dtype == torch.float32
    name = f"mla_decode lens={lens} Tq={Tq} splits={num_splits}"
    assert_close(name, up_project(p, o), decompressed_reference(p), 1e-5)


@pytest.mark.parametrize("lens,Tq", CASES + [([1, 2, 129, 200], 1)])
def test_torch_path_matches_decompressed_reference(lens, Tq):
    p = make_problem(lens, Tq, **TINY, seed=7 + Tq)
    o = run(p, backend="torch")
    assert_close(f"naive_mla_decode lens={lens} Tq={Tq}", up_project(p, o), decompressed_reference(p), 1e-5)
    # In float64 the absorbed form equals the decompressed one up to rounding: absorption is exact.
    o64 = naive_mla_decode(p["q64"], p["rows"].double(), p["seq_lens"], value_dim=p["d_c"], scale=p["scale"])
    assert o64.dtype == torch.float64
    assert_close("naive_mla_decode float64", up_project(p, o64), decompressed_reference(p), 1e-12)


@needs_triton
def test_split_merge_is_exact_for_any_split_count():
    """Many splits with real work each (16-row blocks): the log-sum-exp merge must equal one pass."""
    p = make_problem([200, 45, 3], 2, **TINY, seed=3)
    q, rows, lens = (p[k].to(DEV) for k in ("q", "rows", "seq_lens"))
    ref = decompressed_reference(p)
    one = mla_decode_triton(q, rows, lens, value_dim=p["d_c"], scale=p["scale"], num_splits=1, block_n=16)
    for ns in (2, 3, 5, 13):
        o = mla_decode_triton(q, rows, lens, value_dim=p["d_c"], scale=p["scale"], num_splits=ns, block_n=16)
        assert_close(f"splits={ns} vs reference", up_project(p, o), ref, 1e-5)
        assert_close(f"splits={ns} vs one split", o, one, 1e-6)


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rows_past_seq_lens_are_never_read(backend):
    """NaN, inf or huge garbage past each length must leave the output bit-identical."""
    lens = [5, 70, 1]
    outs = []
    for poison in (0.0, float("nan"), float("inf"), -3e38):
        p = make_problem(lens, 1, **TINY, max_len=90, seed=11, poison=poison)
        outs.append(run(p, backend=backend, num_splits=3))
    assert torch.isfinite(outs[0]).all()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@needs_triton
@pytest.mark.parametrize(
    "dims",
    [
        dict(d_c=24, d_s=12, H=3, d_n=8, d_v=8),  # neither part a power of two
        dict(d_c=40, d_s=0, H=2, d_n=8, d_v=8),  # no tail: value_dim == D
        dict(d_c=16, d_s=5, H=17, d_n=8, d_v=8),  # Tq * H = 68 rows: two row blocks
    ],
)
def test_awkward_dims(dims):
    Tq = 4 if dims["H"] == 17 else 2
    p = make_problem([9, 66], Tq, **dims, seed=dims["H"])
    for ns in (1, 3):
        o = run(p, num_splits=ns)
        assert_close(f"{dims} splits={ns}", up_project(p, o), decompressed_reference(p), 1e-5)


@needs_triton
def test_strided_views():
    """rows as a view of a bigger cache (layer axis, padded row width) and a non-contiguous q."""
    p = make_problem([33, 17], 3, **TINY, seed=5)
    B, N, D = p["rows"].shape
    big = torch.full((2, B, N, D + 8), float("nan"))
    big[1, :, :, :D] = p["rows"]
    rows = big[1, :, :, :D].to(DEV)
    q = p["q"].transpose(1, 2).contiguous().transpose(1, 2).to(DEV)  # [B, Tq, H, D] with t and h strides swapped
    assert not q.is_contiguous() and not rows.is_contiguous()
    o = mla_decode(q, rows, p["seq_lens"].to(DEV), value_dim=p["d_c"], scale=p["scale"], num_splits=2)
    assert_close("strided", up_project(p, o), decompressed_reference(p), 1e-5)


@needs_triton
def test_rows_with_no_visible_key_give_zeros():
    """Unchecked on GPUs (no host sync): seq_len < Tq leaves early query rows with no key; they return zeros."""
    p = make_problem([1, 40], 3, **TINY, seed=9)
    q, rows = p["q"].to(DEV), p["rows"].to(DEV)
    lens = torch.tensor([1, 40], dtype=torch.int32, device=DEV)
    o = mla_decode_triton(q, rows, lens, value_dim=p["d_c"], scale=p["scale"], num_splits=2).cpu()
    assert torch.equal(o[0, :2], torch.zeros_like(o[0, :2]))
    # The last query of sequence 0 sees only key 0, so its output is that row's value part.
    assert_close("single key", o[0, 2], p["rows"][0, 0, : p["d_c"]].expand(TINY["H"], -1), 1e-6)


@needs_triton
def test_nope_is_permutation_invariant():
    """No positions anywhere: shuffling the visible rows of a one-token decode leaves the output unchanged."""
    p = make_problem([50], 1, **TINY, max_len=50, seed=13)
    o = run(p, num_splits=3)
    p["rows"] = p["rows"][:, torch.randperm(50)]
    assert_close("permuted", run(p, num_splits=3), o, 1e-6)


def test_matches_naive_absorbed_attention():
    """Against the readable reference `naive.absorbed_attention` (one sequence at a time: it takes no seq_lens)."""
    from hybrid_attention.ops.mla import naive

    p = make_problem([37, 6], 3, **TINY, seed=21)
    o = run(p, backend="torch" if not (torch.cuda.is_available() or interpreting()) else "auto")
    for b, L in enumerate([37, 6]):
        ref = naive.naive_absorbed_attention(
            p["q"][b : b + 1], p["rows"][b : b + 1, :L], value_dim=p["d_c"], scale=p["scale"], causal=True
        )
        assert_close(f"naive seq {b}", o[b : b + 1].cpu(), ref, 1e-5)


@needs_triton
def test_gradients_take_the_torch_path():
    """The kernel has no backward: "auto" falls back to PyTorch when grad is needed, "triton" refuses."""
    p = make_problem([12, 5], 2, **TINY, seed=17)
    q = p["q"].to(DEV).requires_grad_()
    rows, lens = p["rows"].to(DEV), p["seq_lens"].to(DEV)
    kw = dict(value_dim=p["d_c"], scale=p["scale"])
    o = mla_decode(q, rows, lens, **kw)
    assert o.requires_grad
    o.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="inference-only"):
        mla_decode(q, rows, lens, **kw, backend="triton")
    with torch.no_grad():
        assert_close("no_grad triton", mla_decode(q, rows, lens, **kw, backend="triton"), o.detach(), 1e-5)


def test_default_num_splits_fills_one_wave():
    """132 SMs (H200): B=1 at long context gets one split per resident program; large batches need none."""
    assert default_num_splits(1, 524288, 132) == 264
    assert default_num_splits(32, 32768, 132) == 8  # 256 programs: one wave, never a near-empty second one
    assert default_num_splits(1, 4096, 132) == 32  # at least MIN_SPLIT_TOKENS = 128 rows per split of a full cache
    assert default_num_splits(300, 1 << 20, 132) == 1
    assert default_num_splits(1, 10, 132) == 1


def test_bad_inputs_raise():
    p = make_problem([10, 4], 2, **TINY)
    q, rows, lens = p["q"], p["rows"], p["seq_lens"]
    kw = dict(value_dim=p["d_c"], scale=p["scale"])
    bad = [
        ("q must be", (q[0], rows, lens), kw),
        ("rows must be", (q, rows[0], lens), kw),
        ("does not match", (q, rows[..., :-1], lens), kw),
        ("does not match", (q[:1], rows, lens), kw),
        ("value_dim", (q, rows, lens), dict(kw, value_dim=q.shape[-1] + 1)),
        ("value_dim", (q, rows, lens), dict(kw, value_dim=0)),
        ("seq_lens", (q, rows, lens.long()), kw),
        ("seq_lens", (q, rows, lens[:1]), kw),
        ("seq_lens must lie", (q, rows, torch.tensor([10, 1], dtype=torch.int32)), kw),
        ("seq_lens must lie", (q, rows, torch.tensor([10, rows.shape[1] + 1], dtype=torch.int32)), kw),
        ("dtype", (q.double(), rows, lens), kw),
        ("scale", (q, rows, lens), dict(kw, scale=0.0)),
        ("num_splits", (q, rows, lens), dict(kw, num_splits=0)),
        ("unit stride", (q, rows.transpose(1, 2).contiguous().transpose(1, 2), lens), kw),
        ("shorter than Tq", (q, rows[:, :1], torch.tensor([1, 1], dtype=torch.int32)), kw),
        ("backend", (q, rows, lens), dict(kw, backend="cuda")),
    ]
    for match, args, kwargs in bad:
        with pytest.raises(ValueError, match=match):
            mla_decode(*args, **kwargs)
    with pytest.raises(ValueError, match="seq_lens"):
        naive_mla_decode(q, rows, lens.long(), **kw)
    if not (torch.cuda.is_available() or interpreting()):
        with pytest.raises(ValueError, match="backend='triton'"):
            mla_decode(q, rows, lens, **kw, backend="triton")
    with pytest.raises(ValueError, match="backend='triton'"):
        mla_decode(q.double(), rows.double(), lens, **kw, backend="triton")  # fp64 has no Triton path
