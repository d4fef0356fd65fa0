"""Generation: prefill the prompt once, then decode one token at a time with the cache.

`generate_stream` yields each new token as it is produced (the CLI streams text from it); `generate` collects them.
Sampling: temperature (0 = greedy), then top-k, then top-p (nucleus), in that order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]. temperature 0 picks the argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the tokens before it already reach top_p (the most likely one always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_args(model, input_ids, max_new_tokens, temperature, top_k, top_p) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: expected a non-empty prompt [B, T], got shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r}; expected an integer >= 0")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature}; expected >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k={top_k}; expected None or >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p}; expected None or in (0, 1]")
    vocab = model.config.vocab_size
    if input_ids.min() < 0 or input_ids.max() >= vocab:
        lo, hi = int(input_ids.min()), int(input_ids.max())
        raise ValueError(f"generate: prompt token ids must be in [0, {vocab}), got [{lo}, {hi}]")


@torch.no_grad()
def generate_stream(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yields one LongTensor [B] per new token. Stops early once every sequence has produced `eos_token_id`
    (sequences that finished earlier keep emitting eos)."""
    _check_args(model, input_ids, max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    batch_size, prompt_len = input_ids.shape
    cache = model.make_cache(batch_size, prompt_len + max_new_tokens)
    logits = model(input_ids, cache=cache).logits[:, -1]
    finished = torch.zeros(batch_size, dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        token = sample_next_token(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
            finished |= token == eos_token_id
        yield token
        if step + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
            return
        logits = model(token[:, None], cache=cache).logits[:, -1]


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """input_ids [B, T] -> [B, T + new] with new <= max_new_tokens (fewer when every sequence hit eos)."""
    new = list(generate_stream(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator))
    return torch.cat([input_ids, *[t[:, None] for t in new]], dim=1)
