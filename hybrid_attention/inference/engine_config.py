"""The serving engine's limits and how many cache pages they come to on a device (docs/inference.md, "Serving")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid_attention.checks import is_finite_number, is_int

# Prompt tokens per iteration while sequences decode. An eager forward of a prefill chunk costs the host about the same
# time whatever its length, so on a GPU a small chunk leaves the device idle: larger chunks give long prompts fewer
# iterations to their first token, at a longer iteration for the sequences decoding beside them.
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """max_running: sequences that hold cache at once (prefilling or decoding). max_context: prompt + completion
    tokens of one sequence. max_queue: requests waiting for cache before new ones are refused. max_batched_tokens:
    prompt tokens one iteration prefills while sequences decode (their own tokens go through the decode step; None:
    `batched_tokens` picks it for the device). max_prefilling:
    sequences in prefill at once. max_prefill_chunk: prompt tokens one iteration may compute when no sequence
    decodes (None: what `inference/prefill.py` picks from the free memory, at least max_batched_tokens): a long
    prompt alone then prefills in a few large chunks. page_size: tokens per cache page. num_pages: pages of the
    latent cache (None: from `cache_memory_fraction` on CUDA, enough for max_running sequences of max_context tokens
    elsewhere). cache_memory_fraction: the share of the GPU's memory the server may fill, weights and activations
    included, the pages taking what is left. cuda_graphs: decode from CUDA graphs (None: on CUDA).
    """

    max_running: int = 64
    max_context: int = 8192
    max_queue: int = 256
    max_batched_tokens: int | None = None
    max_prefilling: int = 4
    max_prefill_chunk: int | None = None
    page_size: int = 64
    num_pages: int | None = None
    cache_memory_fraction: float = 0.9
    cuda_graphs: bool | None = None

    def __post_init__(self):
        for name in ("max_running", "max_context", "max_prefilling", "page_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}; expected an integer >= 1")
        if not is_int(self.max_queue) or self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue!r}; expected an integer >= 0")
        for name in ("num_pages", "max_prefill_chunk", "max_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r}; expected None or an integer >= 1")
        fraction = self.cache_memory_fraction
        if not is_finite_number(fraction) or not 0 < fraction <= 1:
            raise ValueError(f"cache_memory_fraction={fraction!r}; expected a number in (0, 1]")

    def batched_tokens(self, device: torch.device) -> int:
        """max_batched_tokens, or for None: GPU_BATCHED_TOKENS on a GPU, CPU_BATCHED_TOKENS elsewhere."""
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        return GPU_BATCHED_TOKENS if torch.device(device).type == "cuda" else CPU_BATCHED_TOKENS

    @property
    def pages_per_sequence(self) -> int:
        return math.ceil(self.max_context / self.page_size)

    def decode_batch_sizes(self) -> list[int]:
        """The batch sizes a decode step is captured at (a running batch is padded up to the next): 1, 2, 4, then
        multiples of 8, and max_running."""
        sizes = [b for b in (1, 2, 4) if b < self.max_running] + list(range(8, self.max_running, 8))
        return sorted({*sizes, self.max_running})


def cache_pages(
    config: EngineConfig, *, page_bytes: int, device: torch.device, activation_bytes: int = 0, reserve: int = 2**28
) -> int:
    """Pages of the latent cache: `config.num_pages`; else on CUDA what `cache_memory_fraction` of the card leaves
    after what is allocated now, the `activation_bytes` a prefill chunk needs and `reserve` (decode graphs, sampling),
    at most what max_running sequences of max_context tokens can use; elsewhere that most. ValueError when not one
    sequence of max_context tokens fits."""
    most = config.max_running * config.pages_per_sequence
    if config.num_pages is not None:
        pages = config.num_pages
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = config.cache_memory_fraction * total - (total - free) - activation_bytes - reserve
        pages = min(most, max(0, int(budget // page_bytes)))
    else:
        pages = most
    if pages < config.pages_per_sequence:
        raise ValueError(
            f"the cache holds {pages} pages of {config.page_size} tokens, fewer than one sequence of max_context="
            f"{config.max_context} tokens needs ({config.pages_per_sequence}); lower the context or give the cache "
            "more memory (cache_memory_fraction, num_pages)"
        )
    return pages
