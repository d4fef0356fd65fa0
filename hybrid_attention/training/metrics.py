"""Training metrics: FLOPs per token, model FLOPs utilisation against a device's peak, and validation loss."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybrid_attention.data.batches import eval_batches

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
    """Training FLOPs per token (forward + backward = 3x forward).

    6 N for the N non-embedding parameters, plus sequence mixing, which N does not count:
    - MLA, causal softmax (mean context T/2): forward 2 H (d_qk + d_v) T/2 per token;
    - KDA, chunkwise with C = 64 (Kimi Linear report): forward 6 K^2 + 3 C K + C^2 per token and head.
    """
    c = model.config
    num_mla = sum(kind == "mla" for kind in c.layer_types)
    num_kda = c.num_layers - num_mla
    d_qk = c.mla_qk_nope_head_dim + c.mla_qk_shared_head_dim
    mla = num_mla * 2 * c.mla_num_heads * (d_qk + c.mla_v_head_dim) * seq_len / 2
    K = c.kda_head_dim
    kda = num_kda * c.kda_num_heads * (6 * K * K + 3 * KDA_CHUNK * K + KDA_CHUNK * KDA_CHUNK)
    return 6.0 * non_embedding_parameters(model) + 3.0 * (mla + kda)


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, byte_lengths: torch.Tensor, *, batch_size, seq_len, num_batches, autocast):
    """Mean loss (nats per predicted token) and bits per byte over fixed validation windows."""
    was_training = model.training
    model.eval()
    device = byte_lengths.device
    nll = torch.zeros((), dtype=torch.float64, device=device)
    count, nbytes = 0, torch.zeros((), dtype=torch.long, device=device)
    for x in eval_batches(tokens, batch_size, seq_len, num_batches):
        x = x.to(device, non_blocking=True)
        with autocast():
            loss = model(x, labels=x, return_logits=False).loss
        n = x[:, 1:].numel()
        nll += loss.double() * n
        count += n
        nbytes += byte_lengths[x[:, 1:]].sum()
    model.train(was_training)
    loss = float(nll) / count
    return loss, float(nll) / math.log(2) / max(1, int(nbytes))
