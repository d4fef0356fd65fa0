"""Training metrics: FLOPs per token, model FLOPs utilisation against a device's peak, and validation loss."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from hybrid_attention.data.loader import eval_starts

KDA_CHUNK = 64  # the chunk length the FLOPs count assumes for the chunkwise KDA form

# Dense bf16 tensor-core peaks from the vendors' datasheets, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "4090": 165e12,
    "B200": 2250e12,
}


def peak_flops(device_name: str) -> float | None:
    """Datasheet dense bf16 peak of a device by name (e.g. "NVIDIA H200"), or None when it is not in the table."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "H200" before "H20"
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters doing matmuls: all but input embedding tables (a lookup) unless they double as the LM head."""
    head = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    return model.num_parameters() - sum(n for i, n in lookups.items() if i not in head)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) of `model` (its `config` and parameters):
    `config_flops_per_token` with its non-embedding parameters."""
    return config_flops_per_token(model.config, non_embedding_parameters(model), seq_len)


def config_flops_per_token(c, non_embedding: int, seq_len: int) -> float:
    """Training FLOPs per token of a model with HybridConfig `c` and `non_embedding` parameters doing matmuls.

    6 N for the N non-embedding parameters, plus sequence mixing, which N does not count:
    - MLA, causal softmax (mean context T/2): forward 2 H (d_qk + d_v) T/2 per token;
    - KDA, chunkwise with C = 64 (Kimi Linear report): forward 6 K^2 + 3 C K + C^2 per token and head.
    """
    num_mla = sum(kind == "mla" for kind in c.layer_types)
    num_kda = c.num_layers - num_mla
    d_qk = c.mla_qk_nope_head_dim + c.mla_qk_shared_head_dim
    mla = num_mla * 2 * c.mla_num_heads * (d_qk + c.mla_v_head_dim) * seq_len / 2
    K = c.kda_head_dim
    kda = num_kda * c.kda_num_heads * (6 * K * K + 3 * KDA_CHUNK * K + KDA_CHUNK * KDA_CHUNK)
    return 6.0 * non_embedding + 3.0 * (mla + kda)


def _windows(split, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """Windows [len(starts), seq_len] (int64) of a split: a 1-D token tensor or a `ShardSet`."""
    if isinstance(split, torch.Tensor):
        return split[torch.from_numpy(starts)[:, None].to(split.device) + torch.arange(seq_len, device=split.device)]
    return torch.from_numpy(split.windows(starts, seq_len))


@torch.no_grad()
def evaluate(model, split, byte_lengths: torch.Tensor, *, batch_size, seq_len, num_batches, autocast, documents=False):
    """Mean loss (nats per predicted token) and bits per byte over fixed validation windows (`loader.eval_starts`)
    of `split` (a 1-D token tensor or a `ShardSet`). `documents` (a ShardSet and a `PackedRows` model): each window
    cut at its document starts, as `train --doc-mask` trains; a position that would predict across one is skipped."""
    was_training = model.training
    model.eval()
    device = byte_lengths.device
    nll = torch.zeros((), dtype=torch.float64, device=device)
    count, nbytes = 0, torch.zeros((), dtype=torch.long, device=device)
    starts = eval_starts(split.numel(), batch_size, seq_len, num_batches)
    for i in range(0, len(starts), batch_size):
        rows = starts[i : i + batch_size]
        x = _windows(split, rows, seq_len).to(device, non_blocking=True).long()
        predicted = torch.ones(x.shape, dtype=torch.bool)  # targets x[:, t] that some position predicts
        predicted[:, 0] = False
        kw = {}
        if documents:
            kw["doc_starts"] = [split.document_starts(int(s), seq_len) for s in rows]
            for row, cut in enumerate(kw["doc_starts"]):
                predicted[row, torch.from_numpy(cut)] = False
        with autocast():
            loss = model(x, labels=x, return_logits=False, **kw).loss
        n = int(predicted.sum())
        nll += loss.double() * n
        count += n
        nbytes += byte_lengths[x[predicted.to(device)]].sum()
    model.train(was_training)
    loss = float(nll) / count
    return loss, float(nll) / math.log(2) / max(1, int(nbytes))
