"""What `hybrid-attention info` says about training a model: FLOPs per token and the memory a batch needs on a card,
with and without activation checkpointing (training/memory.py)."""

from __future__ import annotations

from hybrid_attention.choices import ACTIVATION_CHECKPOINTING
from hybrid_attention.config import HybridConfig
from hybrid_attention.model_size import ModelSize
from hybrid_attention.training.memory import binary_size, largest_batch, training_memory, usable_bytes
from hybrid_attention.training.metrics import config_flops_per_token


def training_lines(
    config: HybridConfig,
    size: ModelSize,
    *,
    batch_size: int,
    seq_len: int,
    grad_accum: int,
    optimizer: str,
    card_bytes: float | None,
    card_name: str | None,
) -> list[str]:
    """Lines for `info`: FLOPs per token at `seq_len`, then the memory of a step per activation checkpointing choice,
    and whether it fits a card of `card_bytes` (None: no card named, no fit column)."""
    non_embedding = size.parameters - (0 if config.tie_embeddings else size.embedding)
    flops = config_flops_per_token(config, non_embedding, seq_len)
    lines = [
        f"training FLOPs per token at --seq-len {seq_len:,}: {flops:.3g} (6 x {non_embedding:,} non-embedding "
        f"parameters, and the sequence mixing)",
    ]
    flags = f"--batch-size {batch_size:,} x --seq-len {seq_len:,}, --grad-accum {grad_accum:,}, --optimizer {optimizer}"
    kw = dict(batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, optimizer=optimizer, size=size)
    base = training_memory(config, **kw)
    lines.append(f"training memory per device, {flags} (float32 weights under bf16 autocast, the CUDA kernels):")
    lines.append(
        f"  weights {binary_size(base.weights)}, gradients {binary_size(base.gradients)}, optimizer state "
        f"{binary_size(base.optimizer)}; and by --activation-checkpointing:"
    )
    usable = None if card_bytes is None else usable_bytes(card_bytes)
    header = ["", "activations", "weight copies", "working", "peak"]
    if usable is not None:
        header += [f"fits {card_name} ({binary_size(usable)} of {binary_size(card_bytes)})", "largest --batch-size"]
    rows = [header]
    for kind in ACTIVATION_CHECKPOINTING:
        m = training_memory(config, checkpointing=kind, **kw)
        row = [
            kind,
            binary_size(m.activations),
            binary_size(m.weight_copies),
            binary_size(m.working),
            binary_size(m.peak),
        ]
        if usable is not None:
            most = largest_batch(
                config, seq_len=seq_len, memory=usable, grad_accum=grad_accum, optimizer=optimizer, checkpointing=kind
            )
            row += ["yes" if m.peak <= usable else "no", f"{most:,}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if usable is None:
        lines.append("  (--card h100|h200 or --device-memory GIB says whether a step fits a card)")
    return lines
