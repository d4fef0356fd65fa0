"""transformers on a CUDA GPU: `HybridAttentionForCausalLM.generate` equals our eager decoding token for token
(float32 and bf16, greedy and seeded sampling, a left-padded batch), and the layers converted from transformers' own
Kimi Linear / GLM-5-next KDA and Kimi Linear MLA, running our CUDA kernels in bf16, are as accurate as transformers'
layers in bf16 against the same layers in float64 on the CPU (a whole sequence, then decode steps through both
caches). Run: `python -m pytest -q tests/gpu/hf/test_hf_gpu.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

from transformers import DynamicCache  # noqa: E402

from hybrid_attention.config import HybridConfig  # noqa: E402
from hybrid_attention.hf import HybridAttentionForCausalLM  # noqa: E402
from hybrid_attention.hf.convert import convert_kda, convert_mla  # noqa: E402
from hybrid_attention.inference.generate import generate  # noqa: E402
from hybrid_attention.model import HybridLM
from tests.helpers import (
    assert_as_accurate,  # noqa: E402
    needs_cuda,  # noqa: E402
)
from tests.hf.test_convert import (  # noqa: E402
    Float32AsFloat64,
    _causal_mask,
    kimi_linear_mla,
    transformers_kda,
    transformers_torch_functions,
)

pytestmark = needs_cuda


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 checks are against float32 math: no TF32 matmuls while these tests run."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_cuda_equals_ours(dtype):
    torch.manual_seed(0)
    ours = HybridLM(HybridConfig.from_preset("tiny", residual="block_attnres", attnres_block_size=3)).cuda().eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".query"):
                p.normal_()
    ours = ours.to(dtype)
    hf = HybridAttentionForCausalLM.from_hybrid_lm(ours).eval()
    eager = dict(cuda_graph=False, pack_projections=False)  # the same kernels as transformers' loop runs
    prompt = torch.randint(0, 256, (3, 17), device="cuda")
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    theirs = hf.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs, generate(ours, prompt, 24, temperature=0, attention_mask=mask, **eager))
    torch.manual_seed(7)
    theirs = hf.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.9, top_k=0, top_p=0.95)
    generator = torch.Generator(device="cuda").manual_seed(7)
    mine = generate(ours, prompt, 24, temperature=0.9, top_p=0.95, generator=generator, **eager)
    assert torch.equal(theirs, mine)


def _layer_outputs(layer, x, splits, make_cache, call):
    """(whole-sequence output, outputs of `splits` pieces through one cache)."""
    with torch.no_grad():
        full = call(layer, x, None, 0)
        cache, outs, start = make_cache(), [], 0
        for n in splits:
            outs.append(call(layer, x[:, start : start + n], cache, start))
            start += n
    return full, torch.cat(outs, dim=1)


CASES = [("glm5_next", -5.0), ("glm5_next", None), ("kimi_linear", None)]


@pytest.mark.parametrize(("source", "lower_bound"), CASES)
def test_converted_kda_on_cuda_as_accurate_as_transformers(source, lower_bound):
    config, ref64 = transformers_kda(source, lower_bound, hidden_size=512, linear_num_heads=4, linear_head_dim=64)
    ours = convert_kda(copy.deepcopy(ref64)).to("cuda", torch.bfloat16)  # backend "auto": our Triton kernels
    theirs = copy.deepcopy(ref64).to("cuda", torch.bfloat16)
    x = torch.randn(2, 200, 512, dtype=torch.float64)
    splits = [150, 1, 1, 37, 1, 10]

    def hf_call(layer, piece, cache, _):
        return layer(piece, cache)

    def our_call(layer, piece, cache, _):
        return layer(piece, cache=cache)

    with transformers_torch_functions(), Float32AsFloat64():  # the float64 reference runs on the CPU
        expected = _layer_outputs(ref64, x, splits, lambda: DynamicCache(config=config), hf_call)
    xc = x.to("cuda", torch.bfloat16)
    baseline = _layer_outputs(theirs, xc, splits, lambda: DynamicCache(config=config), hf_call)
    got = _layer_outputs(ours, xc, splits, lambda: ours.empty_cache(2), our_call)
    for label, a, b, c in zip(("forward", "cached"), got, expected, baseline, strict=True):
        assert_as_accurate(f"KDA {source} {label}", a.float(), b.float(), c.float(), floor=2.0**-8)


@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_converted_mla_on_cuda_as_accurate_as_transformers(q_lora_rank):
    overrides = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64)
    config, ref64 = kimi_linear_mla(q_lora_rank, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, **overrides)
    ours = convert_mla(copy.deepcopy(ref64)).to("cuda", torch.bfloat16)
    theirs = copy.deepcopy(ref64).to("cuda", torch.bfloat16)
    x = torch.randn(2, 200, 512, dtype=torch.float64)
    splits = [150, 1, 1, 37, 1, 10]

    def hf_call(layer, piece, cache, past):
        return layer(piece, _causal_mask(past, piece.shape[1]).to(piece), cache)[0]

    def our_call(layer, piece, cache, _):
        if cache is not None:
            cache.seqlens.advance(piece.shape[1])  # the caller counts the tokens it feeds (HybridLM.forward does)
        return layer(piece, cache=cache)

    with transformers_torch_functions(), Float32AsFloat64():  # the float64 reference runs on the CPU
        expected = _layer_outputs(ref64, x, splits, lambda: DynamicCache(config=config), hf_call)
    xc = x.to("cuda", torch.bfloat16)
    baseline = _layer_outputs(theirs, xc, splits, lambda: DynamicCache(config=config), hf_call)
    got = _layer_outputs(ours, xc, splits, lambda: ours.empty_cache(2, 200), our_call)
    for label, a, b, c in zip(("forward", "cached"), got, expected, baseline, strict=True):
        assert_as_accurate(f"MLA {label}", a.float(), b.float(), c.float(), floor=2.0**-8)
