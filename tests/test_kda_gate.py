"""The bounded KDA gate: range, formula, dtypes, gradients at extreme logits, and a long run at the bound."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import chunk_kda, kda_gate, recurrent_kda
from tests.helpers import assert_close

H, K = 3, 8


def gate_params(dtype=torch.float32):
    """A_log around 0 and dt_bias as the layer initialises it (inverse softplus of log-uniform [1e-3, 1e-1])."""
    A_log = 0.5 * torch.randn(H, dtype=dtype)
    dt = torch.exp(torch.rand(H * K, dtype=torch.float64) * math.log(100.0) + math.log(1e-3))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(dtype)
    return A_log, dt_bias


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_strictly_inside_for_realistic_logits(dtype, lower_bound):
    torch.manual_seed(0)
    z = (3.0 * torch.randn(4, 50, H, K)).to(dtype)
    A_log, dt_bias = gate_params()
    g = kda_gate(z, A_log, dt_bias, lower_bound=lower_bound)
    assert g.dtype == torch.float32 and g.shape == z.shape
    assert (g > lower_bound).all() and (g < 0).all()


def test_matches_formula_in_float64():
    torch.manual_seed(1)
    z = 4.0 * torch.randn(2, 7, H, K, dtype=torch.float64)
    A_log, dt_bias = gate_params(torch.float64)
    g = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float64
    x = A_log.exp()[:, None] * (z + dt_bias.view(H, K))
    assert_close("gate", g, -5.0 / (1.0 + torch.exp(-x)), 1e-14)
    g32 = kda_gate(z.float(), A_log.float(), dt_bias.float(), lower_bound=-5.0)
    assert_close("gate float32", g32, g, 1e-6)


@pytest.mark.parametrize("extreme", [1e4, -1e4])
def test_extreme_logits_stay_bounded_with_finite_gradients(extreme):
    torch.manual_seed(2)
    z = torch.full((2, 5, H, K), extreme).requires_grad_()
    z.data[0, 0] = torch.randn(H, K)  # mix in ordinary logits so some gradients are non-zero
    A_log, dt_bias = (p.requires_grad_() for p in gate_params())
    g = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    # Where sigmoid rounds to 0 or 1 the value touches the closed bounds, never beyond them.
    assert torch.isfinite(g).all() and (g >= -5.0).all() and (g <= 0).all()
    grads = torch.autograd.grad((g * torch.randn_like(g)).sum(), (z, A_log, dt_bias))
    for name, grad in zip(("z", "A_log", "dt_bias"), grads, strict=True):
        assert torch.isfinite(grad).all(), f"d{name} is not finite"
    assert grads[0][0, 0].abs().sum() > 0


def test_leading_dims_and_bad_shapes():
    A_log, dt_bias = gate_params()
    assert kda_gate(torch.randn(H, K), A_log, dt_bias).shape == (H, K)
    assert kda_gate(torch.randn(2, 3, 4, H, K), A_log, dt_bias).shape == (2, 3, 4, H, K)
    with pytest.raises(ValueError, match="A_log must be"):
        kda_gate(torch.randn(2, H, K), A_log[:2], dt_bias)
    with pytest.raises(ValueError, match="dt_bias must be"):
        kda_gate(torch.randn(2, H, K), A_log, dt_bias.view(H, K))
    with pytest.raises(ValueError, match="z must be"):
        kda_gate(torch.randn(H * K), A_log, dt_bias)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(torch.randn(2, H, K), A_log, dt_bias, lower_bound=0.0)
    with pytest.raises(ValueError, match="floating"):
        kda_gate(torch.ones(2, H, K, dtype=torch.long), A_log, dt_bias)


def test_gate_at_the_bound_over_4096_steps_is_finite():
    """Every step at the strongest decay the gate allows (sigmoid rounds to 1: g == lower_bound exactly)."""
    torch.manual_seed(3)
    B, T, Hh, Kk, V = 1, 4096, 1, 16, 8
    A_log, dt_bias = torch.zeros(Hh), torch.zeros(Hh * Kk)
    g = kda_gate(torch.full((B, T, Hh, Kk), 1e4), A_log, dt_bias, lower_bound=-5.0)
    assert (g == -5.0).all()
    q = F.normalize(torch.randn(B, T, Hh, Kk), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(B, T, Hh, Kk), dim=-1).requires_grad_()
    v = torch.randn(B, T, Hh, V, requires_grad=True)
    beta = torch.rand(B, T, Hh, requires_grad=True)
    h0 = torch.randn(B, Hh, Kk, V, requires_grad=True)
    g.requires_grad_()
    o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    grads = torch.autograd.grad(o.sum() + S.sum(), (q, k, v, g, beta, h0))
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    for name, grad in zip(("q", "k", "v", "g", "beta", "h0"), grads, strict=True):
        assert torch.isfinite(grad).all(), f"d{name} is not finite"
    with torch.no_grad():
        ref_o, ref_S = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("o", o, ref_o, 1e-5)
    assert_close("S", S, ref_S, 1e-5)
