"""HybridLM: layer pattern, incremental decoding equals the full forward, causality, AttnRes wiring, training."""

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close

RESIDUALS = ["standard", "attnres", "block_attnres"]


def tiny_model(residual="attnres", dtype=torch.float64, seed=0, **overrides) -> HybridLM:
    torch.manual_seed(seed)
    cfg = HybridConfig.from_preset("tiny", residual=residual, **overrides)
    return HybridLM(cfg, kda_backend="torch").to(dtype).eval()


def randomize_attnres(model: HybridLM, seed=1) -> None:
    """Non-zero pseudo-queries and key-norm weights, so the AttnRes path is exercised beyond a plain mean."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".query"):
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        elif "_res.key_norm" in name:
            p.data.copy_(1 + 0.5 * torch.rand(p.shape, generator=gen, dtype=p.dtype))


def test_k3_scaled_layer_pattern():
    cfg = HybridConfig.from_preset("k3-scaled")
    kda = [i + 1 for i, kind in enumerate(cfg.layer_types) if kind == "kda"]
    mla = [i + 1 for i, kind in enumerate(cfg.layer_types) if kind == "mla"]
    assert kda == [1, 2, 3, 5, 6, 7, 9, 10, 11]
    assert mla == [4, 8, 12, 13]
    assert cfg.num_layers == 13 and cfg.hidden_size == 1024 and cfg.residual == "attnres"
    assert (cfg.kda_num_heads, cfg.kda_head_dim) == (8, 128)
    assert (cfg.mla_num_heads, cfg.mla_kv_lora_rank, cfg.mla_qk_nope_head_dim) == (8, 256, 96)
    assert (cfg.mla_qk_shared_head_dim, cfg.mla_v_head_dim, cfg.intermediate_size) == (32, 128, 2816)
    all_mla = HybridConfig.from_preset("k3-scaled-all-mla")
    assert all_mla.layer_types == ("mla",) * 13 and all_mla.hidden_size == cfg.hidden_size


def test_config_round_trip_and_errors():
    cfg = HybridConfig.from_preset("tiny", residual="block_attnres", attnres_block_size=3)
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="layer_types\\[1\\]"):
        HybridConfig.from_preset("tiny", layer_types=("kda", "gla"))
    with pytest.raises(ValueError, match="residual"):
        HybridConfig.from_preset("tiny", residual="hyper")
    with pytest.raises(ValueError, match="unknown preset"):
        HybridConfig.from_preset("huge")
    with pytest.raises(ValueError, match="unknown fields"):
        HybridConfig.from_dict({**cfg.to_dict(), "rope_theta": 1e4})
    with pytest.raises(ValueError, match="kda_backend"):
        HybridLM(HybridConfig.from_preset("tiny"), kda_backend="cuda")
    with pytest.raises(ValueError, match="lower_bound"):
        HybridConfig.from_preset("tiny", kda_lower_bound=0.0)
    with pytest.raises(ValueError, match="hidden_size"):
        HybridConfig.from_preset("tiny", hidden_size=0)


def assert_incremental_equals_full(model: HybridLM, name: str, prefill: int, chunk_end: int, total: int) -> None:
    """Logits of a prefill of `prefill` tokens, a chunk up to `chunk_end` on the non-empty cache and then one token
    at a time up to `total` equal one full forward's (float64)."""
    ids = torch.randint(0, 256, (2, total))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.make_cache(2, 32)
        pieces = [model(ids[:, :prefill], cache=cache).logits]  # prefill
        pieces.append(model(ids[:, prefill:chunk_end], cache=cache).logits)  # chunked prefill on a non-empty cache
        pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(chunk_end, total)]  # token by token
    assert cache.seq_len == total
    assert_close(f"{name} incremental logits", torch.cat(pieces, dim=1), full, 1e-10)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_incremental_decoding_equals_full_forward(residual):
    model = tiny_model(residual)
    randomize_attnres(model)
    assert_incremental_equals_full(model, residual, prefill=9, chunk_end=14, total=23)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_model_is_causal(residual):
    model = tiny_model(residual)
    randomize_attnres(model)
    ids = torch.randint(0, 256, (1, 30))
    changed = ids.clone()
    changed[:, 17:] = torch.randint(0, 256, (1, 13))
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert_close("logits before the change", a[:, :17], b[:, :17], 1e-12)
    assert not torch.allclose(a[:, 17:], b[:, 17:])


def test_attnres_zero_init_equals_standard():
    """Zero pseudo-queries + negligible eps: the AttnRes model computes the standard model's logits."""
    for residual in ["attnres", "block_attnres"]:
        standard = tiny_model("standard", norm_eps=1e-30)
        other = tiny_model(residual, norm_eps=1e-30, seed=5)
        missing, unexpected = other.load_state_dict(standard.state_dict(), strict=False)
        assert unexpected == []
        assert missing and all("_res." in name for name in missing), missing
        ids = torch.randint(0, 256, (2, 19))
        with torch.no_grad():
            assert_close(f"{residual} vs standard", other(ids).logits, standard(ids).logits, 1e-12)


def test_block_attnres_size_one_is_full_attnres():
    full = tiny_model("attnres")
    randomize_attnres(full)
    block = tiny_model("block_attnres", attnres_block_size=1)
    block.load_state_dict(full.state_dict())
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        assert torch.equal(block(ids).logits, full(ids).logits)
        block.config.attnres_block_size = 2  # negative control: real blocks mix differently
        assert not torch.allclose(block(ids).logits, full(ids).logits)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_a_few_steps_lower_the_loss(residual):
    model = tiny_model(residual, dtype=torch.float32).train()
    ids = torch.randint(0, 256, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_loss_is_shifted_cross_entropy():
    model = tiny_model("standard")
    ids = torch.randint(0, 256, (2, 9))
    labels = ids.clone()
    labels[0, 4] = -100
    out = model(ids, labels=labels)
    logp = out.logits[:, :-1].log_softmax(-1)
    picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = labels[:, 1:] != -100
    assert_close("loss", out.loss, -(picked[mask]).mean(), 1e-12)


def test_gradients_reach_every_parameter():
    model = tiny_model("block_attnres", dtype=torch.float32).train()
    randomize_attnres(model)
    ids = torch.randint(0, 256, (2, 20))
    model(ids, labels=ids).loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert dead == []


def test_cache_accounting():
    model = tiny_model("attnres", dtype=torch.float32)
    cfg = model.config
    cache = model.make_cache(3, 50)
    row = cfg.mla_kv_lora_rank + cfg.mla_qk_shared_head_dim
    assert model.cache_bytes_per_token(torch.float32) == 1 * row * 4
    width = cfg.kda_num_heads * cfg.kda_head_dim
    per_kda = cfg.kda_num_heads * cfg.kda_head_dim**2 * 4 + 3 * width * (cfg.kda_conv_size - 1) * 4
    assert model.state_bytes_per_sequence(torch.float32) == 3 * per_kda
    expected = 3 * (50 * model.cache_bytes_per_token(torch.float32) + model.state_bytes_per_sequence(torch.float32))
    assert cache.nbytes() == expected


def test_logits_to_keep_gives_the_last_positions_logits():
    model = tiny_model("attnres")
    randomize_attnres(model)
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        full = model(ids, labels=ids)
        for keep in (1, 5, 19):
            out = model(ids, labels=ids, logits_to_keep=keep)
            assert out.logits.shape == (2, keep, 256)
            assert_close(f"last {keep} logits", out.logits, full.logits[:, -keep:], 1e-12)
            assert_close("loss beside logits_to_keep", out.loss, full.loss, 1e-12)  # the loss reads every position
        cache = model.make_cache(2, 32)
        model(ids[:, :7], cache=cache, return_logits=False)
        last = model(ids[:, 7:], cache=cache, logits_to_keep=1).logits
    assert_close("a chunk's last logits on a non-empty cache", last, full.logits[:, -1:], 1e-10)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(ids, logits_to_keep=bad)


def test_bad_inputs_raise():
    model = tiny_model("attnres")
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 4))
    cache = model.make_cache(1, 8)
    with pytest.raises(ValueError, match="max_seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="batch size"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="labels shape"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 5, dtype=torch.long))
