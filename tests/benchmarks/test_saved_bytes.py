"""What one training step keeps for the backward (benchmarks/saved_bytes.py), per token and layer, against a budget
built from the layer sizes: the tensors each layer needs, once each, in the dtype it needs them in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.saved_bytes import per_token_bytes, saved_tensors
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM

BF16, F32, I64 = 2, 4, 8


def _config() -> HybridConfig:
    # Gated MLA layers only: on CPU the KDA layer runs its chunked PyTorch reference, not the kernels that training
    # runs (the GPU test covers the hybrid).
    return HybridConfig.from_preset("tiny", residual="standard", layer_types=("mla", "mla"), vocab_size=96)


def _layer_budget(c: HybridConfig) -> int:
    """Bytes per token one standard-residual [MLA, MLP] layer may keep under bf16 autocast."""
    D, F_, H = c.hidden_size, c.intermediate_size, c.mla_num_heads
    d_qk, d_s = c.mla_qk_nope_head_dim + c.mla_qk_shared_head_dim, c.mla_qk_shared_head_dim
    d_c, d_v = c.mla_kv_lora_rank, c.mla_v_head_dim
    norms = 2 * (F32 * D + F32)  # each norm: its float32 input and 1/rms
    mlp = BF16 * (D + 3 * F_)  # the input cast once, gate, up, SiLU(gate) * up
    # The input cast once; q; the latent before its norm (and its 1/rms); the cache row [c ; k_s]; k, v, o of the
    # attention and its log-sum-exp; sigmoid(gate) and the gated output.
    mla = BF16 * (D + H * d_qk + d_c + (d_c + d_s) + H * d_qk + H * d_v + H * d_v + 2 * H * d_v) + F32 * (1 + H)
    return norms + mlp + mla


def _head_budget(c: HybridConfig) -> int:
    """Bytes per token of everything outside the layers: token ids, the final norm, the chunked head + loss."""
    return I64 + (F32 * c.hidden_size + F32) + (BF16 * c.hidden_size + F32 + I64)


def _slope(model, **kwargs):
    return per_token_bytes(model, batch=2, seq_lens=(24, 56), depth=2, autocast=torch.bfloat16, **kwargs)[0]


def test_standard_model_saves_no_more_than_its_layers_need():
    torch.manual_seed(0)
    model = HybridLM(_config()).train()
    slope = _slope(model)
    c = model.config
    for i in range(c.num_layers):
        assert 0 < slope[f"layers.{i}"] <= _layer_budget(c), (i, slope[f"layers.{i}"], _layer_budget(c))
    head = sum(b for g, b in slope.items() if not g.startswith("layers."))
    assert 0 < head <= _head_budget(c), (head, _head_budget(c))


def test_logits_for_the_loss_exceed_the_head_budget():
    # Negative control: F.cross_entropy over the full logits keeps O(vocab) bytes per token, which the budget of the
    # chunked head rules out.
    torch.manual_seed(0)
    model = HybridLM(_config()).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, _ = saved_tensors(model, lambda: F.cross_entropy(model(ids).logits.flatten(0, 1).float(), ids.flatten()))
    head = sum(s.nbytes for s in saved if not s.module.startswith("layers.")) / ids.numel()
    assert head > _head_budget(model.config) + F32 * model.config.vocab_size
