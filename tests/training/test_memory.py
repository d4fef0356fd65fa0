"""The training memory estimate (training/memory.py) against what a step holds on the CPU: the bytes autograd keeps for
the backward (every saved storage once, `benchmarks/saved_bytes.py`), the parameters, gradients and optimizer state."""

from __future__ import annotations

import pytest
import torch

from benchmarks.saved_bytes import saved_tensors
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.model_size import model_size
from hybrid_attention.training.activation_checkpointing import apply_activation_checkpointing
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.memory import CARD_MEMORY, binary_size, largest_batch, training_memory, usable_bytes
from hybrid_attention.training.optim import build_optimizers
from tests.helpers import needs_triton

# The estimate counts the tensors the code saves, so it misses only what it rounds: a few bias and norm vectors left
# out of the weight copies, the convolutions' padding columns.
MARGIN = 0.02


def _tiny(residual: str, **overrides) -> HybridConfig:
    layers = ("kda", "mla", "kda")  # both mixers, and a KDA layer after the first (with an AttnRes before its mixer)
    return HybridConfig.from_preset("tiny", residual=residual, vocab_size=96, layer_types=layers, **overrides)


@needs_triton
@pytest.mark.parametrize(
    "residual, checkpointing",
    [("standard", "none"), ("standard", "all"), ("attnres", "none"), ("block_attnres", "mlp")],
)
def test_activations_match_the_saved_tensors(residual, checkpointing):
    """The KDA chunk op and the AttnRes stream run their Triton kernels (the interpreter on the CPU), which are the
    autograd Functions that training runs on CUDA; norms, convolutions and SwiGLU their eager forms (`fused=False`).
    A block of 3 sublayers straddles the decoder layers."""
    config = _tiny(residual, attnres_block_size=3)
    torch.manual_seed(0)
    model = HybridLM(config, kda_backend="triton", attnres_backend="triton").train()
    apply_activation_checkpointing(model, checkpointing)
    ids = torch.randint(0, config.vocab_size, (1, 64))  # one whole chunk of the KDA op
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, loss = saved_tensors(model, lambda: model(ids, labels=ids, return_logits=False).loss)
    measured = sum(s.nbytes for s in saved)  # a checkpointed sublayer's input included: the checkpoint saves it
    estimate = training_memory(config, batch_size=1, seq_len=64, checkpointing=checkpointing, fused=False)
    predicted = estimate.activations + estimate.weight_copies
    assert abs(measured - predicted) <= MARGIN * measured, (measured, predicted, estimate.per_token)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weights_gradients_and_optimizer_state_are_exact(optimizer):
    config = _tiny("block_attnres")
    torch.manual_seed(0)
    model = HybridLM(config, kda_backend="torch")
    optimizers = build_optimizers(model, optimizer=optimizer, lr=1e-3, weight_decay=0.1)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model(ids, labels=ids).loss.backward()
    for opt in optimizers:
        opt.step()
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    state = [t for opt in optimizers for s in opt.state.values() for k, t in s.items() if k != "step"]
    estimate = training_memory(config, batch_size=2, seq_len=16, optimizer=optimizer)
    assert estimate.weights == nbytes(model.parameters())
    assert estimate.gradients == nbytes(p.grad for p in model.parameters())
    assert estimate.optimizer == nbytes(state) > 0


def test_checkpointing_and_accumulation_move_the_peak_the_right_way():
    config = HybridConfig.from_preset("k3-3b")
    size = model_size(config)
    peak = {
        kind: training_memory(config, batch_size=4, seq_len=2048, checkpointing=kind, size=size).peak
        for kind in ("none", "mixer", "mlp", "all")
    }
    assert peak["all"] < min(peak["mixer"], peak["mlp"]) <= max(peak["mixer"], peak["mlp"]) < peak["none"]
    one = training_memory(config, batch_size=4, seq_len=2048, size=size)
    two = training_memory(config, batch_size=4, seq_len=2048, grad_accum=2, size=size)
    assert two.peak > one.peak and two.activations == one.activations  # gradients held through the second backward
    usable = usable_bytes(CARD_MEMORY["h100"])
    most = largest_batch(config, seq_len=2048, memory=usable, checkpointing="all")
    assert most >= 1
    fits = lambda b: training_memory(config, batch_size=b, seq_len=2048, checkpointing="all").peak <= usable  # noqa: E731
    assert fits(most) and not fits(most + 1)


@pytest.mark.parametrize("preset", ["k3-scaled", "k3-1b", "k3-3b"])
def test_trains_defaults_for_a_preset_fit_an_80_gb_card(preset):
    run = TrainConfig.create(preset=preset)
    estimate = training_memory(
        HybridConfig.from_preset(preset),
        batch_size=run.batch_size,
        seq_len=run.seq_len,
        grad_accum=run.grad_accum,
        optimizer=run.optimizer,
        checkpointing=run.activation_checkpointing,
    )
    assert estimate.peak <= usable_bytes(CARD_MEMORY["h100"]), binary_size(estimate.peak)
    assert run.batch_size * run.grad_accum * run.seq_len == 16 * 2048  # the same tokens per step at every size
