"""The transformers model class: config mapping, AutoConfig / AutoModelForCausalLM, the safetensors round trip, the
forward and loss against HybridLM, transformers' `generate` token for token against ours (greedy and seeded sampling;
the tiny preset, and a Block AttnRes model without the MLA output gate; left-padded batches), the cache across calls,
and clear errors for what is not supported. Float32 on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from hybrid_attention.config import HybridConfig  # noqa: E402
from hybrid_attention.hf import HybridAttentionCache, HybridAttentionConfig, HybridAttentionForCausalLM  # noqa: E402
from hybrid_attention.hf.modeling import CACHE_KWARG  # noqa: E402
from hybrid_attention.inference.generate import generate  # noqa: E402
from hybrid_attention.model import HybridLM  # noqa: E402
from tests.helpers import assert_close  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # loading bars and generation-config notes
    yield
    transformers.logging.set_verbosity(verbosity)


def trained_like(config: HybridConfig, seed: int = 0) -> HybridLM:
    """A HybridLM with non-trivial AttnRes mixing (zero pseudo-queries would average the sources)."""
    torch.manual_seed(seed)
    model = HybridLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_()
    return model


@pytest.fixture(scope="module")
def tiny():
    ours = trained_like(HybridConfig.from_preset("tiny"))
    return ours, HybridAttentionForCausalLM.from_hybrid_lm(ours).eval()


@pytest.fixture(scope="module")
def block_attnres():
    config = HybridConfig.from_preset(
        "tiny",
        residual="block_attnres",
        attnres_block_size=3,
        layer_types=("kda", "mla", "kda", "kda", "mla"),
        mla_output_gate=False,
    )
    ours = trained_like(config, seed=1)
    return ours, HybridAttentionForCausalLM.from_hybrid_lm(ours).eval()


# ---------------------------------------------------------------------------------------------------- config
def test_config_maps_one_to_one_and_validates():
    config = HybridConfig.from_preset("k3-scaled", mla_q_lora_rank=48, tie_embeddings=True, mla_output_gate=False)
    hf = HybridAttentionConfig.from_hybrid_config(config, eos_token_id=3)
    assert hf.to_hybrid_config() == config
    assert hf.layer_types == list(config.layer_types) and hf.tie_word_embeddings and hf.eos_token_id == 3
    assert HybridAttentionConfig().to_hybrid_config() == HybridConfig()
    assert isinstance(AutoConfig.for_model("hybrid_attention"), HybridAttentionConfig)
    with pytest.raises(ValueError, match=r"layer_types\[1\] = 'attn'; expected one of \('kda', 'mla'\)"):
        HybridAttentionConfig(layer_types=["kda", "attn"])
    with pytest.raises(ValueError, match="mla_output_gate='no'; expected True or False"):
        HybridAttentionConfig(mla_output_gate="no")


def test_wrapper_initialises_like_hybrid_lm():
    config = HybridConfig.from_preset("tiny")
    torch.manual_seed(5)
    ours = HybridLM(config)
    torch.manual_seed(5)
    theirs = HybridAttentionForCausalLM(HybridAttentionConfig.from_hybrid_config(config))
    mine = ours.state_dict()
    assert {f"model.{k}" for k in mine} == set(theirs.state_dict())
    for name, value in theirs.model.state_dict().items():
        assert torch.equal(value, mine[name]), name


@pytest.mark.parametrize("tie", [False, True])
def test_save_and_load_round_trip(tmp_path, tie):
    ours = trained_like(HybridConfig.from_preset("tiny", tie_embeddings=tie), seed=2)
    HybridAttentionForCausalLM.from_hybrid_lm(ours).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, HybridAttentionForCausalLM) and loaded.config.to_hybrid_config() == ours.config
    for name, value in ours.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name
    assert (loaded.model.lm_head.weight is loaded.model.embed.weight) == tie
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours(ids).logits)


def test_forward_and_loss_equal_hybrid_lm(tiny):
    ours, hf = tiny
    ids = torch.randint(0, 256, (2, 11))
    labels = ids.masked_fill(torch.rand(2, 11) < 0.3, -100)
    with torch.no_grad():
        out, ref = hf(ids, labels=labels), ours(ids, labels=labels)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    assert out.get(CACHE_KWARG) is None
    assert isinstance(hf(ids, return_dict=False), tuple)


def test_logits_to_keep_gives_the_last_positions_logits(tiny):
    """generate passes logits_to_keep=1 (the wrapper's forward names it), so a prompt computes one position's logits;
    a left-padded batch and labels keep working beside it."""
    _, hf = tiny
    assert hf._supports_logits_to_keep()
    ids = torch.randint(0, 256, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        for attention_mask in (None, mask):
            full = hf(ids, attention_mask=attention_mask, labels=ids)
            for keep in (1, 3):
                out = hf(ids, attention_mask=attention_mask, labels=ids, logits_to_keep=keep)
                assert out.logits.shape == (3, keep, 256)
                assert_close(f"last {keep} logits", out.logits, full.logits[:, -keep:], 1e-5)
                assert torch.equal(out.loss, full.loss)
    with pytest.raises(ValueError, match="logits_to_keep=-1; expected an integer >= 0"):
        hf(ids, logits_to_keep=-1)


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("which", ["tiny", "block_attnres"])
def test_generate_equals_ours_token_for_token(which, request):
    ours, hf = request.getfixturevalue(which)
    prompt = torch.randint(0, 256, (2, 9))
    greedy = hf.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(greedy, generate(ours, prompt, 16, temperature=0))
    for seed, (temperature, top_k, top_p) in enumerate([(1.0, None, None), (0.8, 20, None), (1.3, None, 0.9)]):
        torch.manual_seed(seed)  # transformers samples from the global generator
        theirs = hf.generate(
            prompt, max_new_tokens=16, do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0
        )
        options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        mine = generate(ours, prompt, 16, **options, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(theirs, mine), (temperature, top_k, top_p)


def test_left_padded_batch_equals_ours(tiny):
    ours, hf = tiny
    ids = torch.randint(0, 256, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :7] = 0
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs, generate(ours, ids, 10, temperature=0, attention_mask=mask))
    alone = generate(ours, ids[2:, 7:], 10, temperature=0)  # row 2 is one token of prompt
    assert torch.equal(theirs[2, 7:], alone[0])


def test_right_padding_and_later_padding_are_rejected(tiny):
    _, hf = tiny
    ids = torch.randint(0, 256, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with pytest.raises(ValueError, match=r"row 1 is not left-padded .*padding_side = 'left'"):
        hf(ids, attention_mask=mask)
    cache = HybridAttentionCache()
    hf(ids, cache=cache, use_cache=True)
    padded_step = torch.cat([torch.ones(2, 6), torch.zeros(2, 1)], dim=1).long()
    with pytest.raises(ValueError, match="padding after the first call is not supported"):
        hf(ids[:, :1], attention_mask=padded_step, cache=cache)


def test_cache_across_calls_grows_and_equals_full_forward(tiny):
    _, hf = tiny
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        full = hf(ids).logits
        out = hf(ids[:, :5], use_cache=True)  # a cache with room for exactly 5 tokens
        logits, cache = [out.logits], out[CACHE_KWARG]
        assert isinstance(cache, HybridAttentionCache) and cache.hybrid.max_seq_len == 5
        for start, stop in [(5, 6), (6, 13), (13, 14), (14, 20)]:
            out = hf(ids[:, start:stop], cache=cache, use_cache=True)
            logits.append(out.logits)
    assert cache.get_seq_length() == 20 and cache.hybrid.host_lengths == [20, 20]
    assert_close("cached calls vs full forward", torch.cat(logits, dim=1), full, 1e-5)


def test_generate_without_cache_equals_with_cache(tiny):
    _, hf = tiny
    prompt = torch.randint(0, 256, (1, 6))
    a = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    b = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(a, b)


def test_unsupported_uses_raise_clear_errors(tiny):
    _, hf = tiny
    prompt = torch.randint(0, 256, (1, 4))
    with pytest.raises(ValueError, match="beam_search is not supported; use greedy decoding or sampling"):
        hf.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False)
    with pytest.raises(ValueError, match="the cache must be a HybridAttentionCache .* got DynamicCache"):
        hf(prompt, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match=r"unsupported arguments \['output_attentions'\]"):
        hf(prompt, output_attentions=True)
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        hf(inputs_embeds=torch.zeros(1, 4, 64))
    cache = HybridAttentionCache()
    hf(prompt, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="holds 1 sequences, but the input has 2"):
        hf(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(NotImplementedError, match="reordering .* is not supported"):
        cache.reorder_cache(torch.zeros(1, dtype=torch.long))


def test_core_package_does_not_import_transformers():
    code = (
        "import sys, hybrid_attention, hybrid_attention.model, hybrid_attention.inference.generate, "
        "hybrid_attention.cli, hybrid_attention.training.loop, hybrid_attention.runs.checkpoint; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
