"""Prefill: feed a prompt into the cache in chunks whose size comes from the free memory (docs/inference.md, "Long
prompts"). Fewer, larger chunks mean fewer passes over the cached prefix; a bound keeps activations a few GiB."""

from __future__ import annotations

import torch
from tqdm import tqdm

from hybrid_attention.checks import is_int
from hybrid_attention.config import HybridConfig

# Largest chunk per sequence: the MLA layers up-project the cached prefix once per chunk, which costs about
# 272 / chunk of their attention FLOPs at k3-scaled sizes (< 1% from here on), while activations keep growing with it.
MAX_CHUNK = 1 << 15
MIN_CHUNK = 64
FREE_FRACTION = 0.4  # of the free GPU memory, for one call's activations (an estimate: keep a margin)
CPU_ACTIVATION_BYTES = 1 << 30  # the CPU has no free-memory query torch can rely on: a fixed budget
PROGRESS_DELAY_S = 3.0  # a prefill shows a progress bar once it has run this long


def activation_bytes_per_token(config: HybridConfig, itemsize: int) -> int:
    """An upper estimate of the activation bytes one prompt token holds at the peak of a prefill call (no autograd):
    the residual stream (with Full AttnRes every sublayer's output stays until the end) plus the widest sublayer's
    temporaries, float32 ones counted twice."""
    c = config
    D, L = c.hidden_size, c.num_layers
    if c.residual == "attnres":
        stream = (2 * L + 3) * D
    elif c.residual == "block_attnres":
        stream = (2 * L // c.attnres_block_size + 4) * D
    else:
        stream = 3 * D
    kda_width = c.kda_num_heads * c.kda_head_dim
    # Projections, conv outputs, gates, chunk intermediates and the per-chunk states of 64 tokens.
    kda = 16 * kda_width + c.kda_num_heads * c.kda_head_dim**2 // 32 + 2 * D
    mlp = 2 * D + 3 * c.intermediate_size
    qk = c.mla_qk_nope_head_dim + c.mla_qk_shared_head_dim
    # Queries, the chunk's keys and values, float32 running output and merge temporaries.
    mla = c.mla_num_heads * (2 * qk + 8 * c.mla_v_head_dim) + 3 * D
    return itemsize * (stream + max(kda, mlp, mla))


def free_bytes(device: torch.device) -> int:
    """Bytes a prefill call may use on `device`: free GPU memory plus what torch's allocator holds unused; a fixed
    budget on the CPU."""
    if device.type != "cuda":
        return CPU_ACTIVATION_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def activation_budget(device: torch.device) -> float:
    """Bytes one prefill call's activations may take on `device`: `FREE_FRACTION` of `free_bytes` on CUDA, the fixed
    CPU budget elsewhere."""
    return free_bytes(device) * (FREE_FRACTION if device.type == "cuda" else 1.0)


def chunk_size_for(budget_bytes: float, bytes_per_token: int, batch_size: int) -> int:
    """Tokens per sequence per call: what `budget_bytes` holds for `batch_size` sequences, rounded down to a power of
    two (chunked prefill then repeats a few attention shapes), within [MIN_CHUNK, MAX_CHUNK]."""
    tokens = int(budget_bytes // (bytes_per_token * batch_size))
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << max(0, tokens.bit_length() - 1)))


def prefill_chunk_size(model, batch_size: int) -> int:
    """Tokens per sequence per prefill call for `model` now: `FREE_FRACTION` of the free memory (a fixed budget on
    the CPU) over `activation_bytes_per_token`, a power of two in [MIN_CHUNK, MAX_CHUNK]."""
    weight = model.embed.weight
    per_token = activation_bytes_per_token(model.config, weight.element_size())
    return chunk_size_for(activation_budget(weight.device), per_token, batch_size)


@torch.no_grad()
def prefill(
    model, input_ids: torch.Tensor, cache, *, chunk_size: int | None = None, progress: bool | None = None
) -> torch.Tensor:
    """Feed input_ids [B, T] into `cache` in chunks of `chunk_size` tokens per sequence (None: `prefill_chunk_size`);
    returns the logits of the last position [B, vocab].

    Only the last chunk computes logits, of its last position alone (`logits_to_keep=1`). progress: a tqdm bar on
    stderr (None: once the prefill has run `PROGRESS_DELAY_S` seconds; True: from the start; False: never).
    """
    B, T = input_ids.shape
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"prefill: chunk_size={chunk_size!r}; expected None or an integer >= 1")
    if T == 0:
        raise ValueError("prefill: input_ids has no tokens (T = 0)")
    chunk = chunk_size or prefill_chunk_size(model, B)
    delay = 0.0 if progress else PROGRESS_DELAY_S
    with tqdm(total=T, desc="prefill", unit="token", unit_scale=True, delay=delay, disable=progress is False) as bar:
        for start in range(0, T, chunk):
            stop = min(T, start + chunk)
            last = stop == T
            out = model(input_ids[:, start:stop], cache=cache, return_logits=last, logits_to_keep=1)
            bar.update(stop - start)
    return out.logits[:, -1]
