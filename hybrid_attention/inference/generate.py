"""Generation: prefill the prompt in chunks, then decode one token at a time with the cache; streaming, sampling and
batches of prompts of different lengths (docs/inference.md, "Generation").
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence

import torch

from hybrid_attention.checks import is_finite_number, is_int
from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.prefill import prefill
from hybrid_attention.ops.warm_start import wait_warm_start

Prompts = torch.Tensor | Sequence[torch.Tensor]


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]. temperature 0 picks the argmax.

    The logits are shifted by their maximum before the division (in float64), so any positive temperature, however
    small, gives finite probabilities: the most likely token keeps logit 0, the others go to -inf as T -> 0.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
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
    # Drawn from float32 probabilities: on CUDA the draw consumes the generator's stream per dtype, and float32 is
    # what transformers' sampling uses, so one seed gives the same tokens through either API.
    probs = logits.softmax(-1).float()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _split_prompts(model, input_ids: Prompts, attention_mask: torch.Tensor | None) -> list[torch.Tensor] | None:
    """Validate the prompts; return them one by one (1-D) when their lengths differ, None for a plain [B, T] batch."""
    vocab = model.config.vocab_size
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
            raise ValueError(f"generate: expected a non-empty prompt [B, T], got shape {tuple(input_ids.shape)}")
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"generate: attention_mask shape {tuple(attention_mask.shape)} != input_ids "
                    f"{tuple(input_ids.shape)}"
                )
            mask = attention_mask.to("cpu")
            if not ((mask == 0) | (mask == 1)).all():
                raise ValueError("generate: attention_mask must hold only 0 (padding) and 1 (token)")
        if mask is None or mask.all():  # no padding: one batched prefill
            prompts = None
            tokens = [input_ids]
        else:
            prompts = []
            for b, row in enumerate(mask.bool()):
                where = row.nonzero().flatten().tolist()
                if not where:
                    raise ValueError(f"generate: attention_mask row {b} is all padding; every prompt needs a token")
                if where[-1] - where[0] + 1 != len(where):
                    raise ValueError(
                        f"generate: attention_mask row {b} has holes; expected one run of ones (left or right padding)"
                    )
                prompts.append(input_ids[b, where[0] : where[-1] + 1])
            tokens = prompts
    else:
        prompts = list(input_ids)
        if not prompts:
            raise ValueError("generate: the list of prompts is empty")
        for b, p in enumerate(prompts):
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
                raise ValueError(f"generate: prompt {b} must be a non-empty 1-D tensor, got {getattr(p, 'shape', p)}")
            if p.device != prompts[0].device:
                raise ValueError(f"generate: prompts are on different devices ({prompts[0].device}, {p.device})")
        if attention_mask is not None:
            raise ValueError("generate: attention_mask is for a padded [B, T] tensor, not a list of prompts")
        tokens = prompts
    for t in tokens:
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"generate: prompt token ids must be integers, got {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"generate: prompt token ids must be in [0, {vocab}), got [{lo}, {hi}]")
    return prompts


def _check_args(max_new_tokens, temperature, top_k, top_p) -> None:
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r}; expected an integer >= 0")
    # Below the smallest normal float64 the division above would meet a flushed (zero) denormal.
    if not is_finite_number(temperature) or not (temperature == 0 or temperature >= sys.float_info.min):
        raise ValueError(f"generate: temperature={temperature!r}; expected 0 (greedy) or a finite number >= 2.2e-308")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"generate: top_k={top_k!r}; expected None or an integer >= 1")
    if top_p is not None and (not is_finite_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"generate: top_p={top_p!r}; expected None or a number in (0, 1]")


def _check_finite(logits: torch.Tensor, index: int) -> None:
    """ValueError when the logits [B, vocab] for new token `index` (0-based) hold NaN or infinite values, which no
    sampling can turn into a token."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(
            f"generate: the logits for new token {index + 1} hold NaN or infinite values; the model's weights are "
            f"damaged, diverged, or too large for {logits.dtype}"
        )


def _decode_step(model, cache, cuda_graph: bool | None, pack_projections: bool) -> DecodeStep:
    """The decode step: captured in a CUDA graph on CUDA (cuda_graph None or True), eager otherwise or on failure."""
    pack = dict(pack_projections=pack_projections)
    if cuda_graph is not None or not model.embed.weight.is_cuda:
        return DecodeStep(model, cache, cuda_graph=bool(cuda_graph), **pack)  # raises for cuda_graph=True off CUDA
    try:
        return DecodeStep(model, cache, cuda_graph=True, **pack)
    except Exception as exc:  # any capture problem: same tokens, only slower (the capture restores the cache)
        warnings.warn(f"generate: CUDA-graph capture failed, decoding eagerly: {exc!r}", RuntimeWarning, stacklevel=3)
        return DecodeStep(model, cache, cuda_graph=False, **pack)


@torch.no_grad()
def generate_stream(
    model,
    input_ids: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    cuda_graph: bool | None = None,
    prefill_chunk_size: int | None = None,
    pack_projections: bool = True,
    progress: bool | None = None,
) -> Iterator[torch.Tensor]:
    """Yields one LongTensor [B] per new token. Stops early once every sequence has produced `eos_token_id`
    (sequences that finished earlier keep emitting eos).

    input_ids: [B, T], or a list of B 1-D prompts of any lengths. attention_mask: [B, T] of 0/1 marking the real
    tokens of a padded batch (one run of ones per row: left or right padding). cuda_graph: None = on CUDA models,
    True = required, False = never. prefill_chunk_size: tokens per sequence per prefill call. pack_projections:
    decode with packed weight copies of the projections that read the same input (`graphs.DecodeStep`; one more
    copy of those weights in memory while generating).
    progress: `prefill`'s bar (None: once it runs a few seconds), for each prompt in turn.
    """
    _check_args(max_new_tokens, temperature, top_k, top_p)
    if cuda_graph and not model.embed.weight.is_cuda:
        raise ValueError(f"generate: cuda_graph=True needs a model on a CUDA device, got {model.embed.weight.device}")
    prompts = _split_prompts(model, input_ids, attention_mask)
    if max_new_tokens == 0:
        return
    if prompts is None:
        batch_size, longest = input_ids.shape
        device = input_ids.device
    else:
        batch_size, longest = len(prompts), max(p.numel() for p in prompts)
        device = prompts[0].device
    cache = model.make_cache(batch_size, longest + max_new_tokens)
    wait_warm_start()  # a warm start still running would otherwise repeat its work beside the prefill
    if prompts is None:
        logits = prefill(model, input_ids, cache, chunk_size=prefill_chunk_size, progress=progress)
    else:
        rows = []
        for b, p in enumerate(prompts):
            single = model.make_cache(1, p.numel())
            rows.append(prefill(model, p[None], single, chunk_size=prefill_chunk_size, progress=progress))
            cache.load_sequence(b, single)
            del single
        logits = torch.cat(rows, dim=0)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    step = None
    for i in range(max_new_tokens):
        if i == 0 or not logits.is_cuda:  # on CUDA the first token's alone: a check is a host sync
            _check_finite(logits, i)
        token = sample_next_token(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
            finished |= token == eos_token_id
        yield token
        if i + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
            return
        if step is None:  # after the first token: its wait is the prefill's alone (the capture restores the cache)
            step = _decode_step(model, cache, cuda_graph, pack_projections)
        logits = step(token)


def generate(model, input_ids: Prompts, max_new_tokens: int, **options) -> torch.Tensor | list[torch.Tensor]:
    """`generate_stream` collected: input_ids [B, T] -> [B, T + new] with new <= max_new_tokens (fewer when every
    sequence hit eos); the new tokens follow the (padded) prompt block. A list of 1-D prompts -> a list of 1-D
    tensors, prompt + new tokens. `options` are `generate_stream`'s (temperature, top_k, top_p, eos_token_id,
    generator, attention_mask, cuda_graph, prefill_chunk_size, pack_projections)."""
    new = list(generate_stream(model, input_ids, max_new_tokens, **options))
    if isinstance(input_ids, torch.Tensor):
        return torch.cat([input_ids, *[t[:, None] for t in new]], dim=1)
    columns = torch.stack(new, dim=1) if new else None
    return [p if columns is None else torch.cat([p, columns[b].to(p.device)]) for b, p in enumerate(input_ids)]
