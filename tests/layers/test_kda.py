"""KimiDeltaAttention layer: shapes and dtypes, cached decoding (token by token and in uneven pieces) equal to
the full forward, causality, gradients to every parameter, initialisation, and input validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.layers.kda import KDACache, KimiDeltaAttention
from hybrid_attention.ops.kda import chunk_kda
from tests.helpers import assert_close

HIDDEN, HEADS, HEAD_DIM = 32, 2, 8


def make_layer(dtype=torch.float64, **kwargs) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(HIDDEN, HEADS, head_dim=HEAD_DIM, **kwargs).to(dtype)
    with torch.no_grad():  # the zero-initialised-style defaults would hide bugs: make every parameter matter
        layer.g_up.bias.normal_()
        layer.o_norm.weight.uniform_(0.5, 1.5)
        layer.A_log.normal_(0.0, 0.5)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_output_shape_and_dtype(dtype):
    torch.manual_seed(0)
    layer = make_layer(dtype)
    x = torch.randn(3, 21, HIDDEN, dtype=dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    cache = layer.empty_cache(3)
    y2 = layer(x, cache)  # chunked path with the cached state
    with torch.no_grad():
        y3 = layer(x[:, :1], cache)  # recurrent path
    assert y2.dtype == dtype and y3.dtype == dtype and torch.isfinite(y3).all()
    assert cache.state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def decode_in_pieces(layer, x, pieces):
    cache = layer.empty_cache(x.shape[0])
    outputs, start = [], 0
    for n in pieces:
        outputs.append(layer(x[:, start : start + n], cache))
        start += n
    assert start == x.shape[1]
    return torch.cat(outputs, dim=1), cache


@pytest.mark.parametrize(
    "pieces",
    [
        [1] * 36,  # token by token (recurrent path)
        [5, 1, 7, 1, 1, 20, 1],  # uneven pieces; the 20-token piece takes the chunked path with an initial state
        [17, 19],  # both pieces chunked
    ],
)
@pytest.mark.parametrize("gate", ["bounded", "softplus", "head"])
def test_cached_decoding_equals_full_forward(pieces, gate):
    torch.manual_seed(1)
    layer = make_layer(gate=gate)
    x = torch.randn(2, 36, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        pieced, cache = decode_in_pieces(layer, x, pieces)
        assert_close("decoded output", pieced, full, 1e-10)
        # The cache now holds the whole prefix: one more token continues exactly as the full forward would.
        x_next = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
        full_next = layer(torch.cat([x, x_next], dim=1))[:, -1:]
        assert_close("next token", layer(x_next, cache), full_next, 1e-10)


def test_prefill_into_the_cache_runs_the_fused_kernels(monkeypatch):
    """backend="triton" (our kernels; the Triton interpreter on CPU): a prefill into the cache calls the chunk op with
    the gate and the q/k L2 norm fused, as the full forward does, and the cached state as its initial state. Pieces
    of 20 and 30 tokens, then one token, equal the full forward."""
    pytest.importorskip("triton")
    import hybrid_attention.layers.kda as kda_module

    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return chunk_kda(*args, **kwargs)

    monkeypatch.setattr(kda_module, "chunk_kda", spy)
    torch.manual_seed(5)
    layer = make_layer(torch.float32, backend="triton")
    x = torch.randn(2, 51, HIDDEN)
    with torch.no_grad():
        full = layer(x)
        pieced, _ = decode_in_pieces(layer, x, [20, 30, 1])
    assert_close("prefill in pieces through the Triton kernels", pieced, full, 1e-5)
    with_cache = [c for c in calls if c["initial_state"] is not None]
    assert len(with_cache) == 2 and all(c["A_log"] is layer.A_log and c["use_qk_l2norm"] for c in with_cache)


def test_cache_is_updated_in_place():
    torch.manual_seed(2)
    layer = make_layer()
    cache = layer.empty_cache(2)
    buffers = (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)
    with torch.no_grad():
        layer(torch.randn(2, 3, HIDDEN, dtype=torch.float64), cache)
        layer(torch.randn(2, 30, HIDDEN, dtype=torch.float64), cache)
    after = (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)
    assert all(a is b for a, b in zip(buffers, after, strict=True))
    assert all(t.abs().sum() > 0 for t in buffers)


def test_cache_with_grad_enabled_matches_and_backpropagates():
    torch.manual_seed(3)
    layer = make_layer()
    x = torch.randn(1, 12, HIDDEN, dtype=torch.float64)
    cache = layer.empty_cache(1)
    y = torch.cat([layer(x[:, :5], cache), layer(x[:, 5:], cache)], dim=1)
    y.sum().backward()
    assert_close("pieces with grad", y.detach(), layer(x).detach(), 1e-10)
    assert not cache.state.requires_grad


def test_causality():
    torch.manual_seed(4)
    layer = make_layer()
    x = torch.randn(2, 40, HIDDEN, dtype=torch.float64)
    t = 22
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    with torch.no_grad():
        y, y2 = layer(x), layer(x2)
    assert torch.equal(y[:, : t + 1], y2[:, : t + 1])
    assert not torch.allclose(y[:, t + 1 :], y2[:, t + 1 :])
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(layer(xg)[:, : t + 1].sum(), xg)
    assert torch.count_nonzero(grad[:, t + 1 :]) == 0 and torch.count_nonzero(grad[:, : t + 1]) > 0


@pytest.mark.parametrize("gate", ["bounded", "softplus", "head"])
def test_gradients_reach_every_parameter(gate):
    torch.manual_seed(5)
    layer = make_layer(torch.float32, gate=gate)
    x = torch.randn(2, 19, HIDDEN)
    (layer(x) * torch.randn(2, 19, HIDDEN)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: bad gradient"


def test_initialisation_and_no_weight_decay_marks():
    layer = KimiDeltaAttention(HIDDEN, HEADS, head_dim=HEAD_DIM)
    assert torch.equal(layer.A_log.detach(), torch.zeros(HEADS))
    dt = F.softplus(layer.dt_bias.detach().double())
    assert dt.shape == (HEADS * HEAD_DIM,) and (dt >= 1e-3 * (1 - 1e-6)).all() and (dt <= 1e-1 * (1 + 1e-6)).all()
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    names = {n for n, _ in layer.named_children()}
    assert names >= {"q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv", "b_proj", "f_down", "f_up"}
    assert names >= {"g_down", "g_up", "o_norm", "o_proj"}
    assert layer.g_up.bias is not None and layer.f_up.bias is None and layer.f_down.out_features == HEAD_DIM


@pytest.mark.parametrize("gate", ["softplus", "head"])
def test_softplus_gates_shapes_initialisation_and_decay(gate):
    """The softplus gates start from A = exp(A_log) in [1, 16]; "head" has one logit and one bias per head, and its
    layer equals a "softplus" layer whose per-channel logits and biases repeat each head's over K."""
    torch.manual_seed(7)
    layer = make_layer(gate=gate)
    fresh = KimiDeltaAttention(HIDDEN, HEADS, head_dim=HEAD_DIM, gate=gate)
    A = fresh.A_log.detach().exp()
    assert ((A >= 1.0 - 1e-6) & (A <= 16.0 + 1e-6)).all() and fresh.gate == gate
    width = HEADS if gate == "head" else HEADS * HEAD_DIM
    assert layer.f_up.out_features == width and layer.dt_bias.shape == (width,)
    if gate == "head":
        twin = make_layer(gate="softplus")
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name == "f_up.weight":
                    p = p.repeat_interleave(HEAD_DIM, 0)
                elif name == "dt_bias":
                    p = p.repeat_interleave(HEAD_DIM)
                twin.get_parameter(name).copy_(p)
        x = torch.randn(2, 20, HIDDEN, dtype=torch.float64)
        assert_close("per-head gate as per-channel softplus", layer(x), twin(x), 1e-12)


def test_empty_cache_shapes():
    layer = make_layer(torch.bfloat16, conv_size=3)
    cache = layer.empty_cache(4)
    assert isinstance(cache, KDACache)
    assert cache.conv_q.shape == (4, HEADS * HEAD_DIM, 2) and cache.conv_q.dtype == torch.bfloat16
    assert cache.state.shape == (4, HEADS, HEAD_DIM, HEAD_DIM) and cache.state.dtype == torch.float32
    assert layer.empty_cache(1, dtype=torch.float64).state.dtype == torch.float64


def test_bad_input_raises():
    layer = make_layer()
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="x must be"):
        layer(x[0])
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(2, 5, HIDDEN + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        layer(x[:, :0])
    with pytest.raises(ValueError, match="cache.conv_q must be"):
        layer(x, layer.empty_cache(3))
    bad_state = layer.empty_cache(2)
    bad_state.state = bad_state.state.float()
    with pytest.raises(ValueError, match="cache.state must be torch.float64"):
        layer(x, bad_state)
    bad_shape = layer.empty_cache(2)
    bad_shape.state = bad_shape.state[:1]
    with pytest.raises(ValueError, match="cache.state must be"):
        layer(x, bad_shape)
    with pytest.raises(ValueError, match="unknown backend"):
        KimiDeltaAttention(HIDDEN, HEADS, head_dim=HEAD_DIM, backend="cuda")
    with pytest.raises(ValueError, match="num_heads"):
        KimiDeltaAttention(HIDDEN, 0)
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(HIDDEN, HEADS, lower_bound=1.0)
    with pytest.raises(ValueError, match="gate must be one of"):
        KimiDeltaAttention(HIDDEN, HEADS, gate="sigmoid")


def test_config_field_selects_the_gate():
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM

    model = HybridLM(HybridConfig.from_preset("tiny", kda_gate="head"))
    gates = {m.gate for m in model.modules() if isinstance(m, KimiDeltaAttention)}
    assert gates == {"head"}
    with pytest.raises(ValueError, match="kda_gate"):
        HybridConfig.from_preset("tiny", kda_gate="sigmoid")
