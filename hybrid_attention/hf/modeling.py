"""`HybridAttentionForCausalLM`: a transformers model (`PreTrainedModel` + `GenerationMixin`) wrapping `HybridLM`,
with greedy and sampled generation over left-padded batches (docs/transformers.md, "The model").
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from hybrid_attention.checks import is_int
from hybrid_attention.hf.cache import HybridAttentionCache
from hybrid_attention.hf.configuration import HybridAttentionConfig
from hybrid_attention.model import HybridLM

# transformers 5.17 names the cache argument `past_key_values`; later versions rename it `cache` (the old name still
# accepted for a while). Both are accepted here; this is the one generate passes.
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
_SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


class HybridAttentionForCausalLM(PreTrainedModel, GenerationMixin):
    """`HybridLM` as a transformers causal LM. input_ids [B, T] -> logits [B, T, vocab] (and the loss with labels)."""

    config_class = HybridAttentionConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # applied when tie_embeddings is set
    _is_stateful = True  # KDA's recurrent state: transformers refuses assisted decoding for such models

    def __init__(self, config: HybridAttentionConfig):
        super().__init__(config)
        self.model = HybridLM(config.to_hybrid_config())
        self.post_init()

    def _init_weights(self, module) -> None:
        # HybridLM initialises every parameter in its constructor (layer-specific inits included); from_pretrained
        # loads them all. Nothing to redo here.
        return

    @classmethod
    def from_hybrid_lm(cls, model: HybridLM, **config_kwargs) -> HybridAttentionForCausalLM:
        """Wrap a (trained) `HybridLM`: the same config and a copy of its weights, on its device and dtype.
        `config_kwargs` are transformers' own config fields (e.g. `eos_token_id`)."""
        config = HybridAttentionConfig.from_hybrid_config(model.config, **config_kwargs)
        param = next(model.parameters())
        wrapper = cls(config).to(device=param.device, dtype=param.dtype)
        wrapper.model.load_state_dict(model.state_dict())
        return wrapper.train(model.training)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    # ----------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: HybridAttentionCache | None = None,
        cache: HybridAttentionCache | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids [B, T] (the tokens the cache has not seen), attention_mask [B, cached columns + T] of 0/1,
        labels [B, T] (-100 ignored; predicted from the previous position). use_cache: return a cache (default:
        when one is passed). `past_key_values` and `cache` are the same argument under transformers' two names.
        logits_to_keep: n > 0 returns the logits of the last n positions only, [B, n, vocab] (generate passes 1, so
        a long prompt computes one position's logits)."""
        self._check_kwargs(input_ids, kwargs)
        if not is_int(logits_to_keep) or logits_to_keep < 0:
            raise ValueError(f"HybridAttentionForCausalLM: logits_to_keep={logits_to_keep!r}; expected an integer >= 0")
        if past_key_values is not None and cache is not None:
            raise ValueError("HybridAttentionForCausalLM: pass the cache once, as `cache` or as `past_key_values`")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, HybridAttentionCache):
            raise ValueError(
                f"HybridAttentionForCausalLM: the cache must be a HybridAttentionCache (KDA states and MLA latent "
                f"rows), got {type(cache).__name__}; pass none and one is made"
            )
        use_cache = cache is not None if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = HybridAttentionCache()
        B, T = input_ids.shape
        hybrid = cache.reserve(self.model, B, T) if use_cache else None
        past = cache.columns if use_cache else 0
        starts = _left_padding(attention_mask, B, past, T)
        if starts is None:
            out = self.model(input_ids, labels=labels, cache=hybrid, logits_to_keep=logits_to_keep)
            logits, loss = out.logits, out.loss
        else:
            logits = self._rows_alone(input_ids, starts, hybrid)
            loss = None if labels is None else _shifted_loss(logits, labels, attention_mask)
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        if use_cache:
            cache.columns += T
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KWARG: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()

    def _rows_alone(self, input_ids: torch.Tensor, starts: list[int], hybrid) -> torch.Tensor:
        """Left-padded first call: row b runs alone on input_ids[b, starts[b]:] (into its own batch-1 cache, then
        copied into row b of `hybrid`). Returns logits [B, T, vocab], zeros at padded positions."""
        B, T = input_ids.shape
        logits = None
        for b, start in enumerate(starts):
            single = None if hybrid is None else self.model.make_cache(1, T - start)
            row = self.model(input_ids[b : b + 1, start:], cache=single).logits[0]  # (T - start, vocab)
            if logits is None:
                logits = row.new_zeros(B, T, row.shape[-1])
            logits[b, start:] = row
            if hybrid is not None:
                hybrid.load_sequence(b, single)
        return logits

    def _check_kwargs(self, input_ids, kwargs) -> None:
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("HybridAttentionForCausalLM: inputs_embeds is not supported; pass input_ids")
        if input_ids is None:
            raise ValueError("HybridAttentionForCausalLM: input_ids is required")
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k != "inputs_embeds")
        if unsupported:
            raise ValueError(
                f"HybridAttentionForCausalLM: unsupported arguments {unsupported} (no attention weights, hidden-state "
                "lists or positions: the model has no positional encoding); expected input_ids, attention_mask, "
                "labels, use_cache, cache / past_key_values, return_dict"
            )

    # -------------------------------------------------------------------------------------------- generation
    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """The columns the cache has not seen yet (all of them without a cache), the cache and the mask."""
        if inputs_embeds is not None:
            raise ValueError("HybridAttentionForCausalLM.generate: inputs_embeds is not supported; pass input_ids")
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        kwargs.pop("is_first_iteration", None)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": kwargs.pop("use_cache", None)}
        if cache is not None:
            inputs["input_ids"] = input_ids[:, cache.get_seq_length() :]
            inputs[CACHE_KWARG] = cache
        # What generate also forwards (e.g. output_attentions=False); forward rejects anything it cannot honour.
        inputs.update({k: v for k, v in kwargs.items() if k not in inputs})
        return inputs

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """generate's hook: a `HybridAttentionCache` with room for `max_cache_length` tokens (or the caller's)."""
        if generation_mode not in _SUPPORTED_MODES:
            raise ValueError(
                f"HybridAttentionForCausalLM.generate: {GenerationMode(generation_mode).value} is not supported; use "
                "greedy decoding or sampling (num_beams=1, no assistant model): KDA keeps one recurrent state per "
                "sequence"
            )
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"HybridAttentionForCausalLM.generate: cache_implementation={generation_config.cache_implementation!r}"
                " is not supported; the model uses its own HybridAttentionCache (leave cache_implementation unset)"
            )
        given = model_kwargs.get(CACHE_KWARG)
        if given is not None:
            if not isinstance(given, HybridAttentionCache):
                raise ValueError(
                    f"HybridAttentionForCausalLM.generate: the cache must be a HybridAttentionCache, got "
                    f"{type(given).__name__}"
                )
            return
        if generation_config.use_cache is False:
            return
        model_kwargs[CACHE_KWARG] = HybridAttentionCache(initial_len=max_cache_length)


def _left_padding(mask: torch.Tensor | None, batch_size: int, past: int, num_tokens: int) -> list[int] | None:
    """None when no new column is padding; else, for a first call (past == 0) with left padding, the index of each
    row's first token. Raises for right padding, holes, padding after the first call and wrong shapes."""
    if mask is None:
        return None
    if mask.shape != (batch_size, past + num_tokens):
        raise ValueError(
            f"HybridAttentionForCausalLM: attention_mask must be [B, cached columns + new tokens] = "
            f"[{batch_size}, {past} + {num_tokens}], got {tuple(mask.shape)}"
        )
    new = mask[:, past:].to("cpu")
    if not ((new == 0) | (new == 1)).all():
        raise ValueError("HybridAttentionForCausalLM: attention_mask must hold only 0 (padding) and 1 (token)")
    if bool(new.all()):
        return None
    if past > 0:
        raise ValueError(
            "HybridAttentionForCausalLM: padding after the first call is not supported (the cache already holds "
            "each row's tokens); pad the prompt on the left and then append tokens to every row"
        )
    starts = []
    for b, row in enumerate(new.bool()):
        where = row.nonzero().flatten().tolist()
        if not where:
            raise ValueError(f"HybridAttentionForCausalLM: attention_mask row {b} is all padding")
        if where[-1] != num_tokens - 1 or len(where) != num_tokens - where[0]:
            raise ValueError(
                f"HybridAttentionForCausalLM: attention_mask row {b} is not left-padded (zeros, then ones); new "
                "tokens follow the last column, so padding must come first (tokenizer.padding_side = 'left')"
            )
        starts.append(where[0])
    return starts


def _shifted_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HybridLM's loss (labels[:, 1:] from positions [:, :-1], -100 ignored) with padded positions ignored too."""
    labels = labels.masked_fill(mask == 0, -100)
    shifted = logits[:, :-1].flatten(0, 1)
    shifted = shifted if shifted.dtype == torch.float64 else shifted.float()
    return F.cross_entropy(shifted, labels[:, 1:].flatten(), ignore_index=-100)
