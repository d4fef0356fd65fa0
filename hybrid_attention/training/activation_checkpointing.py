"""Selective activation checkpointing: the mixers, the MLPs or both recompute their activations in the backward
instead of keeping them (`train --activation-checkpointing`, docs/training.md).

torch's composable `checkpoint` puts `torch.utils.checkpoint`'s non-reentrant form on a module through forward hooks,
so the model's code, its module tree and its parameter names stay as they are (checkpoints load either way).
"""

from __future__ import annotations

from torch import nn

from hybrid_attention.choices import ACTIVATION_CHECKPOINTING


def checkpoint_kind(value: str | bool | None) -> str:
    """The setting as one of `ACTIVATION_CHECKPOINTING`: True (the older on/off setting) is "all", False/None "none"."""
    if value is True:
        return "all"
    if value is False or value is None:
        return "none"
    if value not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"--activation-checkpointing must be one of {', '.join(ACTIVATION_CHECKPOINTING)}, got {value!r}"
        )
    return value


def checkpointed_sublayers(layer: nn.Module, kind: str | bool) -> list[nn.Module]:
    """The sublayers of a decoder layer that `kind` recomputes: its mixer, its MLP, both or none."""
    kind = checkpoint_kind(kind)
    return [m for name, m in (("mixer", layer.mixer), ("mlp", layer.mlp)) if kind in (name, "all")]


def checkpoint_layer(layer: nn.Module, kind: str | bool) -> None:
    """Recompute the sublayers `kind` names of one decoder layer in the backward (in place)."""
    from torch.distributed._composable import checkpoint

    for module in checkpointed_sublayers(layer, kind):
        # The sublayers draw no random numbers, so there is no generator state to save and restore (whose reads a
        # CUDA graph capture would refuse).
        checkpoint(module, preserve_rng_state=False)


def apply_activation_checkpointing(model: nn.Module, kind: str | bool) -> None:
    """`checkpoint_layer` on every decoder layer of a HybridLM."""
    for layer in model.layers:
        checkpoint_layer(layer, kind)
