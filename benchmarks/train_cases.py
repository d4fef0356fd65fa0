"""The models `bench_train.py` trains: our presets, and transformers' Llama (SDPA) and FLA's KDA model at a preset's
sizes (the same hidden size, depth, heads of the same width, SwiGLU width and vocabulary; Llama with full multi-head
attention, FLA with every layer KDA), and the variants a case name can ask for (`:fp8`, `:ckpt-KIND`, `@MODE`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from hybrid_attention.choices import ACTIVATION_CHECKPOINTING, FP8_RECIPES
from hybrid_attention.config import PRESETS, HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.training.metrics import flops_per_token

# The --quick run: the presets' residuals and layer kinds at the tiny preset's widths, CPU-sized depth.
QUICK_LAYERS = 4
QUICK_SIZES = {k: v for k, v in PRESETS["tiny"].items() if k not in ("layer_types", "residual")}
MODES = ("eager", "compile", "graph", "compile+graph")


# ------------------------------------------------------------------------------------------------------------ cases
@dataclasses.dataclass
class Case:
    """A model to train: `build()` -> (model, loss(model, ids), FLOPs per token at seq_len)."""

    name: str
    description: str
    build: Callable[[], tuple[nn.Module, Callable, Callable[[int], float]]]


def _ours(preset: str, sizes: dict, *, doc_len: int | None = None, **overrides) -> Callable:
    def build():
        config = HybridConfig.from_preset(preset, **{**sizes, **overrides})
        if sizes:  # --quick: the last layers of the pattern (the k3 pattern ends with both kinds)
            config = dataclasses.replace(config, layer_types=config.layer_types[-QUICK_LAYERS:])
        model = HybridLM(config)
        loss = lambda m, ids: m(ids, labels=ids, return_logits=False).loss
        if doc_len is not None:
            loss = _packed_loss(doc_len)
        return model, loss, lambda T: flops_per_token(model, T)

    return build


def _packed_loss(doc_len: int) -> Callable:
    """The loss of `train --doc-mask`: rows [B, T] packed into [1, B * T], cut at each row start and at document
    starts drawn once per shape (exponential lengths of mean `doc_len`; a CPU cu_seqlens, as the loader gives)."""
    import numpy as np

    from hybrid_attention.data.loader import cu_seqlens_of_rows

    cuts = {}

    def loss(m, ids):
        B, T = ids.shape
        if (B, T) not in cuts:
            rng = np.random.default_rng(0)
            starts = [np.unique(np.cumsum(rng.exponential(doc_len, T // 2 + 1)).astype(np.int64)) for _ in range(B)]
            cuts[B, T] = cu_seqlens_of_rows([s[(s > 0) & (s < T)] for s in starts], T)
        flat = ids.reshape(1, B * T)
        return m(flat, labels=flat, cu_seqlens=cuts[B, T], return_logits=False).loss

    return loss


class _FlopsProxy(nn.Module):
    """Another library's model seen by `metrics.flops_per_token`: its parameters, and a HybridConfig whose mixing term
    is the same (softmax attention = MLA layers with d_qk = d_v = head_dim and no shared key; KDA layers as ours)."""

    def __init__(self, inner: nn.Module, config: HybridConfig):
        super().__init__()
        self.inner = inner
        self.config = config

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.inner.parameters())


def _reference_sizes(sizes: dict, preset: str) -> dict:
    """Width, depth, heads, FFN and vocabulary of `preset` (with the --quick widths when given)."""
    c = HybridConfig.from_preset(preset, **sizes)
    return dict(
        vocab=c.vocab_size,
        hidden=c.hidden_size,
        layers=min(c.num_layers, QUICK_LAYERS) if sizes else c.num_layers,
        heads=c.kda_num_heads,
        head_dim=c.kda_head_dim,
        ffn=c.intermediate_size,
        conv=c.kda_conv_size,
    )


def _reference_case(model: nn.Module, s: dict, kind: str, **mixing) -> tuple[nn.Module, Callable, Callable]:
    """Another library's causal LM as a case's (model, loss, FLOPs per token): its FLOPs are those of `s["layers"]`
    layers of our `kind` with the `mixing` sizes (see `_FlopsProxy`)."""
    proxy_config = HybridConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        layer_types=(kind,) * s["layers"],
        **mixing,
    )
    proxy = _FlopsProxy(model, proxy_config)
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss
    return model, loss, lambda T: flops_per_token(proxy, T)


def _llama(sizes: dict, preset: str = "k3-scaled") -> Callable:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        s = _reference_sizes(sizes, preset)
        config = LlamaConfig(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            intermediate_size=s["ffn"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"],
            head_dim=s["head_dim"],
            max_position_embeddings=1 << 16,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        return _reference_case(
            LlamaForCausalLM(config),
            s,
            "mla",
            mla_num_heads=s["heads"],
            mla_qk_nope_head_dim=s["head_dim"],
            mla_qk_shared_head_dim=0,
            mla_v_head_dim=s["head_dim"],
        )

    return build


def _fla_kda(sizes: dict, preset: str = "k3-scaled") -> Callable:
    def build():
        try:
            from fla.models import KDAConfig, KDAForCausalLM
        except ImportError as exc:
            raise RuntimeError(f'FLA\'s models are not installed (pip install "hybrid-attention[fla]"): {exc}') from exc

        s = _reference_sizes(sizes, preset)
        config = KDAConfig(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            intermediate_size=s["ffn"],
            num_hidden_layers=s["layers"],
            num_heads=s["heads"],
            head_dim=s["head_dim"],
            conv_size=s["conv"],
            max_position_embeddings=1 << 16,
            tie_word_embeddings=False,
            safe_gate=True,
            lower_bound=-5.0,
        )
        return _reference_case(KDAForCausalLM(config), s, "kda", kda_num_heads=s["heads"], kda_head_dim=s["head_dim"])

    return build


def make_cases(sizes: dict, doc_len: int = 1024) -> dict[str, Case]:
    num_layers = HybridConfig.from_preset("k3-scaled").num_layers  # the "ours-kda" pattern, before --quick cuts it
    docs = f"--doc-mask, documents of {doc_len} tokens on average"
    cases = [
        Case("ours-full", "k3-scaled, Full AttnRes", _ours("k3-scaled", sizes)),
        Case("ours-full-docs", f"k3-scaled, Full AttnRes, {docs}", _ours("k3-scaled", sizes, doc_len=doc_len)),
        Case("ours-block", "k3-scaled-block, Block AttnRes", _ours("k3-scaled-block", sizes)),
        Case("ours-standard", "k3-scaled, standard residual", _ours("k3-scaled", sizes, residual="standard")),
        Case(
            "ours-standard-docs",
            f"k3-scaled, standard residual, {docs}",
            _ours("k3-scaled", sizes, doc_len=doc_len, residual="standard"),
        ),
        Case("ours-all-mla", "k3-scaled-all-mla, standard", _ours("k3-scaled-all-mla", sizes, residual="standard")),
        Case(
            "ours-kda",
            f"{num_layers} KDA layers, standard",
            _ours("k3-scaled", sizes, residual="standard", layer_types=("kda",) * num_layers),
        ),
        Case("llama-sdpa", "transformers LlamaForCausalLM, SDPA", _llama(sizes)),
        Case("fla-kda", "FLA KDAForCausalLM, safe gate", _fla_kda(sizes)),
    ]
    for size, preset in (("1b", "k3-1b"), ("3b", "k3-3b")):  # the pretraining presets and their peers
        c = HybridConfig.from_preset(preset)
        blocks = f"Block AttnRes (blocks of {c.attnres_block_size} sublayers)"
        peers = f"{preset}'s hidden, depth, heads and FFN"
        cases += [
            Case(f"ours-{size}", f"{preset}, {blocks}", _ours(preset, sizes)),
            Case(f"ours-{size}-full", f"{preset}, Full AttnRes", _ours(preset, sizes, residual="attnres")),
            Case(f"ours-{size}-standard", f"{preset}, standard residual", _ours(preset, sizes, residual="standard")),
            Case(f"llama-{size}", f"transformers LlamaForCausalLM, SDPA, {peers}", _llama(sizes, preset)),
            Case(f"fla-{size}", f"FLA KDAForCausalLM, safe gate, {peers}", _fla_kda(sizes, preset)),
        ]
    return {c.name: c for c in cases}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A case as the command line names it: `NAME[:fp8|:fp8-rowwise][:ckpt-KIND][@MODE]`, e.g. `ours-1b:fp8@compile`
    (torchao float8 training of the large projections, `train --fp8`) or `ours-3b:ckpt-mixer@graph` (`train
    --activation-checkpointing mixer`); `mode` None: every --modes."""

    text: str
    name: str
    fp8: str | None = None
    checkpointing: str = "none"
    mode: str | None = None


def parse_spec(text: str, cases: dict, modes: tuple[str, ...]) -> Spec:
    """The `Spec` of `text`; ValueError naming what is wrong."""
    head, _, mode = text.partition("@")
    name, *variants = head.split(":")
    if name not in cases:
        raise ValueError(f"unknown case {name!r}; expected one of {list(cases)}")
    if mode and mode not in modes:
        raise ValueError(f"{text}: mode {mode!r}; expected one of {', '.join(modes)}")
    fp8, checkpointing = None, "none"
    for variant in variants:
        if variant == "fp8" or variant.removeprefix("fp8-") in FP8_RECIPES:
            fp8 = "tensorwise" if variant == "fp8" else variant.removeprefix("fp8-")
        elif variant.removeprefix("ckpt-") in ACTIVATION_CHECKPOINTING:
            checkpointing = variant.removeprefix("ckpt-")
        else:
            raise ValueError(f"{text}: unknown variant {variant!r}; expected fp8, fp8-rowwise or ckpt-mixer|mlp|all")
    if (fp8 or checkpointing != "none") and not name.startswith("ours"):
        raise ValueError(f"{text}: the fp8 and ckpt variants apply to our models (ours-*) only")
    return Spec(text, name, fp8, checkpointing, mode or None)
