"""The KDA gates: range, formula, dtypes, gradients at extreme logits, the per-head form as the per-channel softplus
form, validation, and a long run at the bound."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import chunk_kda, kda_gate, recurrent_kda
from hybrid_attention.ops.kda.gate import head_as_channels
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
        kda_gate(torch.randn(2, H, K), A_log, dt_bias[:-1])
    with pytest.raises(ValueError, match="z must be"):
        kda_gate(torch.randn(H * K), A_log, dt_bias)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(torch.randn(2, H, K), A_log, dt_bias, lower_bound=0.0)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(torch.randn(2, H, K), A_log, dt_bias, lower_bound=float("-inf"))
    with pytest.raises(ValueError, match="floating"):
        kda_gate(torch.ones(2, H, K, dtype=torch.long), A_log, dt_bias)
    with pytest.raises(ValueError, match="gate must be one of"):
        kda_gate(torch.randn(2, H, K), A_log, dt_bias, form="sigmoid")
    with pytest.raises(ValueError, match='"bounded" gate only'):
        kda_gate(torch.randn(2, H, K), A_log, dt_bias, lower_bound=-5.0, form="softplus")
    with pytest.raises(ValueError, match="dt_bias must be"):
        kda_gate(torch.randn(2, H), A_log, dt_bias, form="head")
    assert kda_gate(torch.randn(2, 3, H), A_log, dt_bias[:H], form="head").shape == (2, 3, H)


@pytest.mark.parametrize("form", ["softplus", "head"])
def test_softplus_forms_match_formula_and_are_unbounded(form):
    torch.manual_seed(4)
    A_log, dt_bias = gate_params(torch.float64)
    shape = (2, 9, H) if form == "head" else (2, 9, H, K)
    z = 6.0 * torch.randn(*shape, dtype=torch.float64)
    z.view(-1)[:3] = torch.tensor([60.0, -60.0, 0.0], dtype=torch.float64)  # both softplus regimes and zero
    bias = dt_bias[:H] if form == "head" else dt_bias.view(H, K)
    rate = A_log.exp() if form == "head" else A_log.exp()[:, None]
    u = z + bias
    g = kda_gate(z, A_log, bias.reshape(-1), form=form)
    assert_close(form, g, -rate * torch.log1p(torch.exp(-u.abs())) - rate * u.clamp_min(0), 1e-14)
    assert (g <= 0).all() and g.min() < -20  # no lower bound
    g32 = kda_gate(z.float(), A_log.float(), bias.reshape(-1).float(), form=form)
    assert g32.dtype == torch.float32
    assert_close(f"{form} float32", g32, g, 1e-6)


def test_head_gate_is_the_softplus_gate_on_repeated_logits():
    torch.manual_seed(5)
    A_log, dt_bias = gate_params(torch.float64)
    z = 3.0 * torch.randn(2, 7, H, dtype=torch.float64)
    per_head = kda_gate(z, A_log, dt_bias[:H], form="head")
    zc, bias_c = head_as_channels(z, dt_bias[:H], K)
    assert zc.shape == (2, 7, H, K) and bias_c.shape == (H * K,)
    # Equal up to the last bit of the vectorised log1p (torch may take a different code path per size).
    per_channel = kda_gate(zc, A_log, bias_c, form="softplus")
    assert_close("per channel", per_channel, per_head.unsqueeze(-1).expand_as(zc), 1e-15)


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
