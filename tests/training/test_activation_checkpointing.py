"""Selective activation checkpointing (`train --activation-checkpointing`): the same gradients as the plain step, fewer
bytes kept for the backward, the same parameter names, and the setting's older on/off form."""

from __future__ import annotations

import pytest
import torch

from benchmarks.saved_bytes import saved_tensors
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.training.activation_checkpointing import apply_activation_checkpointing, checkpoint_kind
from hybrid_attention.training.config import TrainConfig
from tests.helpers import rel_err

KINDS = ("none", "mixer", "mlp", "all")


def _step(kind: str, residual: str) -> tuple[int, list[torch.Tensor], list[str]]:
    """(bytes saved for the backward, gradients, parameter names) of one float64 step with `kind` checkpointed."""
    config = HybridConfig.from_preset("tiny", residual=residual, vocab_size=64, layer_types=("kda", "mla", "kda"))
    torch.manual_seed(0)
    model = HybridLM(config).double()
    apply_activation_checkpointing(model, kind)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 37))  # not a multiple of the KDA chunk
    saved, loss = saved_tensors(model, lambda: model(ids, labels=ids, return_logits=False).loss)
    loss.backward()
    names = [name for name, _ in model.named_parameters()]
    return sum(s.nbytes for s in saved), [p.grad for p in model.parameters()], names


@pytest.mark.parametrize("residual", ["standard", "block_attnres"])
def test_gradients_equal_the_plain_step_and_saved_bytes_fall(residual):
    runs = {kind: _step(kind, residual) for kind in KINDS}
    plain_bytes, plain_grads, plain_names = runs["none"]
    for kind in KINDS[1:]:
        nbytes, grads, names = runs[kind]
        assert names == plain_names  # checkpoints load either way
        for name, g, ref in zip(names, grads, plain_grads, strict=True):
            # The recompute repeats the forward's float64 operations: equal up to float64 rounding at most.
            assert rel_err(g, ref) < 1e-12, (kind, name, rel_err(g, ref))
    saved = {kind: runs[kind][0] for kind in KINDS}
    assert saved["all"] < min(saved["mixer"], saved["mlp"]) <= max(saved["mixer"], saved["mlp"]) < saved["none"]


def test_the_setting_and_its_older_on_off_form():
    assert [checkpoint_kind(v) for v in (True, False, None, "mixer")] == ["all", "none", "none", "mixer"]
    assert TrainConfig.create(activation_checkpointing=True).activation_checkpointing == "all"
    assert TrainConfig.create(activation_checkpointing=False).activation_checkpointing == "none"
    assert TrainConfig.create(activation_checkpointing="mlp").activation_checkpointing == "mlp"
    with pytest.raises(ValueError, match="--activation-checkpointing must be one of none, mixer, mlp, all, got 'kda'"):
        TrainConfig.create(activation_checkpointing="kda")
    # A run saved with the on/off setting resumes, with either form given again.
    saved = {**TrainConfig.create().__dict__, "activation_checkpointing": True}
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in saved.items()}
    resumed = TrainConfig.create(saved, activation_checkpointing="mixer", out="runs/tiny")
    assert resumed.activation_checkpointing == "mixer"
