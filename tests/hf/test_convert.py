"""Parity with transformers' own layers: GLM-5-next's KDA layer (bounded and softplus gates), Kimi Linear's KDA
layer (softplus gate) and Kimi Linear's MLA layer (q_lora_rank set and unset), converted by
`hybrid_attention.hf.convert`, give the same outputs on the same weights and inputs. Float64 on the CPU: the full
forward, and a prefill followed by decode steps and a chunk through both caches (transformers' DynamicCache, ours).
Options with no counterpart are rejected.

transformers' reference layers cast to float32 inside (the gate, the KDA recurrence, the norms, the softmax), so they
run here under `Float32AsFloat64`, which turns every float32 request into float64 while they run: their arithmetic,
in float64, so that a mismatch of our own at float32 level (1e-7) cannot hide below the tolerance.
"""

from __future__ import annotations

import contextlib
import inspect
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")
glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
kimi_linear = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

from transformers import DynamicCache  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig  # noqa: E402

from hybrid_attention.hf.convert import convert_kda, convert_mla  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

TOL = 1e-10  # float64 on both sides; any float32 step on ours would show as about 1e-7


class Float32AsFloat64(TorchFunctionMode):
    """While active, a float32 dtype given to any torch function or method (`.to(torch.float32)`,
    `softmax(dtype=torch.float32)`, `.float()`) means float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        swap = lambda a: torch.float64 if a is torch.float32 else a  # noqa: E731
        return func(*(swap(a) for a in args), **{k: swap(v) for k, v in (kwargs or {}).items()})


# transformers' KDA layers call these through a hub wrapper that picks FLA's Triton kernels when FLA is installed;
# a float64 reference on the CPU needs transformers' own PyTorch functions, which the wrapper keeps as __wrapped__.
KERNEL_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                    "causal_conv1d_update")  # fmt: skip


@contextlib.contextmanager
def transformers_torch_functions():
    """While active, transformers' GLM-5-next and Kimi Linear layers run their PyTorch functions, never FLA's."""
    with contextlib.ExitStack() as patches:
        for module in (glm5_next, kimi_linear):
            for name in KERNEL_FUNCTIONS:
                patches.enter_context(mock.patch.object(module, name, inspect.unwrap(getattr(module, name))))
        yield


@pytest.fixture(autouse=True)
def _reference_functions():
    with transformers_torch_functions():
        yield


def _randomize(layer: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere: matrices N(0, 1/fan_in), norm weights in [0.5, 1.5], other vectors N(0, 0.3^2)
    (the decay rates are set by the builders)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() > 1:
                std = p[0].numel() ** -0.5
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)
                continue
            else:
                std = 0.3
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)


def _steps(layer, x, splits, make_cache, call):
    """Run x [B, T, D] through `layer` in pieces of `splits` tokens with one cache; outputs concatenated."""
    cache, outs, start = make_cache(), [], 0
    for n in splits:
        outs.append(call(layer, x[:, start : start + n], cache, start))
        start += n
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------------------------------ KDA
def transformers_kda(source="glm5_next", lower_bound=-5.0, seed=0, **overrides):
    """(config, layer): a GLM-5-next KDA layer (bounded gate with `lower_bound`, or its softplus gate with None) or
    a Kimi Linear one (softplus gate), float64, random weights."""
    values = dict(
        hidden_size=40, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"], rms_norm_eps=1e-5, vocab_size=64, pad_token_id=0,
    )  # fmt: skip
    if source == "glm5_next":
        config = Glm5NextTextConfig(**{**values, "linear_lower_bound": lower_bound, **overrides})
        make = glm5_next.Glm5NextTextLinearAttention
    else:
        config = KimiLinearConfig(**{**values, "bos_token_id": 1, "eos_token_id": 2, **overrides})
        make = kimi_linear.KimiLinearDeltaAttention
    torch.manual_seed(seed)
    layer = make(config, 0).double().eval()
    _randomize(layer, seed)
    with torch.no_grad():
        layer.forget_gate.A_log.uniform_(-1.0, 1.5)  # decay rates exp(A_log) from 0.37 to 4.5
    return config, layer


KDA_SOURCES = [("glm5_next", -5.0), ("glm5_next", -7.5), ("glm5_next", None), ("kimi_linear", None)]


@pytest.mark.parametrize(("source", "lower_bound"), KDA_SOURCES)
def test_kda_full_forward(source, lower_bound):
    _, ref = transformers_kda(source, lower_bound)
    ours = convert_kda(ref, backend="torch")
    assert ours.gate == ("softplus" if lower_bound is None else "bounded")
    x = torch.randn(2, 45, 40, dtype=torch.float64)  # not a multiple of either side's chunk size
    with torch.no_grad():
        with Float32AsFloat64():
            expected = ref(x)
        assert_close(f"KDA forward ({source}, {lower_bound})", ours(x), expected, TOL)


@pytest.mark.parametrize(("source", "lower_bound"), [("glm5_next", -3.0), ("kimi_linear", None)])
def test_kda_prefill_then_decode_through_both_caches(source, lower_bound):
    config, ref = transformers_kda(source, lower_bound, seed=1)
    ours = convert_kda(ref, backend="torch")
    x = torch.randn(2, 31, 40, dtype=torch.float64)
    splits = [21, 1, 1, 1, 5, 1, 1]  # prefill, decode steps, a chunk on a filled cache, decode again

    def theirs(layer, piece, cache, _):
        return layer(piece, cache)

    def mine(layer, piece, cache, _):
        return layer(piece, cache=cache)

    with torch.no_grad():
        with Float32AsFloat64():
            full = ref(x)
            expected = _steps(ref, x, splits, lambda: DynamicCache(config=config), theirs)
        got = _steps(ours, x, splits, lambda: ours.empty_cache(2), mine)
    assert_close("transformers cached vs full", expected, full, TOL)
    assert_close(f"KDA through the caches ({source})", got, expected, TOL)


def test_kda_converter_rejects_what_has_no_counterpart():
    _, layer = transformers_kda(hidden_act="gelu")
    with pytest.raises(ValueError, match="applies 'gelu' after its short conv"):
        convert_kda(layer)
    _, layer = transformers_kda()
    layer.q_proj.bias = torch.nn.Parameter(torch.zeros(24, dtype=torch.float64))
    with pytest.raises(ValueError, match="has a bias on q_proj"):
        convert_kda(layer)
    _, layer = transformers_kda("kimi_linear")
    layer.conv1d.bias = torch.nn.Parameter(torch.zeros(72, dtype=torch.float64))
    with pytest.raises(ValueError, match="has a bias on its short conv"):
        convert_kda(layer)
    with pytest.raises(ValueError, match="expected a transformers KDA layer"):
        convert_kda(torch.nn.Linear(4, 4))


def test_kda_converter_carries_a_gate_bias():
    _, ref = transformers_kda(seed=2)
    ref.g_b_proj.bias = torch.nn.Parameter(torch.randn(24, dtype=torch.float64))
    ours = convert_kda(ref, backend="torch")
    x = torch.randn(1, 9, 40, dtype=torch.float64)
    with torch.no_grad():
        with Float32AsFloat64():
            expected = ref(x)
        assert_close("KDA with a gate bias", ours(x), expected, TOL)


# ------------------------------------------------------------------------------------------------------ MLA
def kimi_linear_mla(q_lora_rank=None, seed=0, **overrides):
    values = dict(
        hidden_size=36, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=10, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=5, qk_rope_head_dim=3, v_head_dim=7, num_hidden_layers=1, layer_types=["full_attention"],
        vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = KimiLinearConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = kimi_linear.KimiLinearAttention(config, 0).double().eval()
    _randomize(layer, seed)
    return config, layer


def _causal_mask(past: int, n: int) -> torch.Tensor:
    """Additive mask [1, 1, n, past + n]: query i (at position past + i) sees keys up to past + i."""
    keys = torch.arange(past + n)
    queries = torch.arange(past, past + n)[:, None]
    return torch.zeros(n, past + n, dtype=torch.float64).masked_fill(keys > queries, float("-inf"))[None, None]


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_kimi_linear_mla_full_forward_and_cached_steps(q_lora_rank):
    config, ref = kimi_linear_mla(q_lora_rank, seed=3 if q_lora_rank else 4)
    ours = convert_mla(ref)
    assert not ours.output_gate and ours.q_lora_rank == q_lora_rank and ours.qk_shared_head_dim == 3
    x = torch.randn(2, 29, 36, dtype=torch.float64)
    splits = [19, 1, 1, 6, 1, 1]

    def theirs(layer, piece, cache, past):
        return layer(piece, _causal_mask(past, piece.shape[1]), cache)[0]

    def mine(layer, piece, cache, _):
        cache.seqlens.advance(piece.shape[1])  # the caller counts the tokens it feeds
        return layer(piece, cache=cache)

    with torch.no_grad():
        with Float32AsFloat64():
            expected_full = ref(x, _causal_mask(0, 29))[0]
            expected = _steps(ref, x, splits, lambda: DynamicCache(config=config), theirs)
        assert_close("MLA forward", ours(x), expected_full, TOL)
        got = _steps(ours, x, splits, lambda: ours.empty_cache(2, 29), mine)
    assert_close("MLA through the caches", got, expected, TOL)


def test_mla_converter_rejects_what_has_no_counterpart():
    _, layer = kimi_linear_mla(attention_bias=True)
    with pytest.raises(ValueError, match="has a bias on kv_a_proj_with_mqa"):
        convert_mla(layer)
    _, layer = kimi_linear_mla(num_key_value_heads=1)
    with pytest.raises(ValueError, match="groups its KV heads"):
        convert_mla(layer)
    _, layer = kimi_linear_mla()
    layer.scaling = 0.1
    with pytest.raises(ValueError, match="scales scores by 0.1"):
        convert_mla(layer)
    with pytest.raises(ValueError, match="expected a transformers MLA layer"):
        convert_mla(torch.nn.Linear(4, 4))
