"""RoPE (`ops.rope`): against rotation as complex numbers, scores that depend on the offset alone, per-sequence
positions, the precision of far positions, and bad shapes."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.rope import apply_rope
from tests.helpers import assert_close
from tests.layers.test_mla import reference_rope


@pytest.mark.parametrize("shape", [(2, 9, 6), (2, 13, 3, 8)])
def test_matches_complex_rotation(shape):
    x = torch.randn(*shape, dtype=torch.float64)
    positions = torch.arange(shape[1])[None]
    ref = reference_rope(x, 100.0)
    assert_close("float64", apply_rope(x, positions, 100.0), ref, 1e-14)
    out32 = apply_rope(x.float(), positions, 100.0)
    assert out32.dtype == torch.float32
    assert_close("float32", out32, ref, 1e-6)
    out16 = apply_rope(x.bfloat16(), positions, 100.0)
    assert out16.dtype == torch.bfloat16
    assert_close("bf16", out16, ref, 1e-2)
    assert_close("position 0 is the identity", apply_rope(x[:, :1], positions[:, :1], 100.0), x[:, :1], 1e-15)


def test_scores_depend_on_the_offset_only():
    """<R(p) q, R(s) k> = <R(p + m) q, R(s + m) k>: a shift of both positions leaves the score as it is, a shift of
    one changes it."""
    q, k = torch.randn(2, 1, 16, dtype=torch.float64), torch.randn(2, 1, 16, dtype=torch.float64)
    rot = lambda x, p: apply_rope(x, torch.tensor([[p]]), 1e4)  # noqa: E731
    score = lambda p, s: (rot(q, p) * rot(k, s)).sum(-1)  # noqa: E731
    assert_close("shifted by 1000", score(1007, 1000), score(7, 0), 1e-10)
    assert_close("shifted by 30000", score(30007, 30000), score(7, 0), 1e-10)
    assert (score(8, 0) - score(7, 0)).abs().max() > 1e-3


def test_positions_per_sequence():
    x = torch.randn(3, 5, 2, 4, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [3, 0, 1, 2, 0]])
    out = apply_rope(x, positions, 1e4)
    for b in range(3):
        for t in range(5):
            single = apply_rope(x[b : b + 1, t : t + 1], positions[b : b + 1, t : t + 1], 1e4)
            assert_close(f"sequence {b}, token {t}", out[b, t], single[0, 0], 1e-14)


def test_far_positions_keep_float32_precision():
    """At 32K tokens a float32 angle would be off by about 2e-3 radians; the rotation stays at float32 rounding."""
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    positions = torch.tensor([[32765, 32766, 32767, 32768]])
    shifted = torch.cat([torch.zeros(1, 32765, 32, dtype=torch.float64), x], dim=1)
    ref = reference_rope(shifted, 1e4)[:, 32765:]
    assert_close("32K positions, float32", apply_rope(x.float(), positions, 1e4), ref, 1e-6)


def test_bad_shapes():
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(1, 3, 5), torch.arange(3)[None], 1e4)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.randn(2, 3, 4), torch.arange(4)[None], 1e4)
    with pytest.raises(ValueError, match=r"\[B, T, d\]"):
        apply_rope(torch.randn(3, 4), torch.arange(3)[None], 1e4)
