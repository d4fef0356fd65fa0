"""The hybrid decoder: KDA and Gated MLA mixers in a 3:1 pattern, SwiGLU MLPs, and Attention Residuals.

`HybridConfig` is one flat dataclass with named presets (`HybridConfig.from_preset("k3-scaled")`). `HybridLM` is a
pre-norm decoder: embedding -> blocks [mixer, MLP] -> final norm -> LM head. The residual stream is wired by
`config.residual`:

- "standard": h <- h + f(norm(h)) for every sublayer (attention and MLP are separate sublayers);
- "attnres": Full Attention Residuals: sublayer l reads a softmax-over-depth mix of the embedding and every earlier
  sublayer output (docs/math.md, "Attention Residuals"), and a final AttnRes mixes all sources before the output
  norm;
- "block_attnres": Block AttnRes: sublayers are grouped into blocks of `attnres_block_size` sublayers; inside a
  block the outputs are summed, across blocks a sublayer attends over the completed block sums and the partial sum
  of its own block.

`config.attnres_backend` picks how AttnRes runs (the vocabulary of `hybrid_attention.backends`): "auto" takes the
fused differentiable Triton ops on CUDA (each AttnRes fused with the RMSNorm that reads it, sources never stacked,
Block AttnRes in its two-phase form; see `layers.attnres.attn_res_stream`) and the readable list path elsewhere or
inside `backends.use_reference()`; "triton" forces the fused ops (CPU under the Triton interpreter); "torch" forces
the list path. Full AttnRes without autograd takes the inference path (one preallocated sources buffer,
`ops.attnres.fused.attn_res_norm`: its Triton kernel where the rule picks it, unless the backend is "torch").

With zero pseudo-queries (their init) AttnRes averages its sources, and because every sublayer and the head start with
a scale-invariant RMSNorm, an AttnRes model computes the same function as the standard one with the same weights. The
parameter names are shared, so a standard checkpoint loads into an AttnRes model with only AttnRes parameters missing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.backends import BACKENDS, use_triton
from hybrid_attention.cache import HybridCache
from hybrid_attention.checks import is_int
from hybrid_attention.layers.attnres import AttnRes, attn_res_stream, block_attn_res_stream
from hybrid_attention.layers.kda import KimiDeltaAttention
from hybrid_attention.layers.mla import GatedMLA
from hybrid_attention.layers.mlp import SwiGLU
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.packed import PackedProjections, linear
from hybrid_attention.layers.seqlens import SeqLens
from hybrid_attention.ops.attnres.fused import attn_res_norm
from hybrid_attention.ops.attnres.rows import fused_train_supported
from hybrid_attention.ops.cross_entropy import linear_cross_entropy
from hybrid_attention.ops.kda.gate import GATE_FORMS, check_lower_bound

LAYER_TYPES = ("kda", "mla")
RESIDUALS = ("standard", "attnres", "block_attnres")
KDA_BACKENDS = (*BACKENDS, "fla")
ATTNRES_BACKENDS = BACKENDS


def _k3_layer_types(all_mla: bool = False) -> tuple[str, ...]:
    # KDA at layers 1-3, 5-7, 9-11; MLA at 4, 8, 12 and a final MLA at 13 (1-based): 3 KDA per MLA.
    pattern = ("kda", "kda", "kda", "mla") * 3 + ("mla",)
    return tuple("mla" for _ in pattern) if all_mla else pattern


PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized: tests and the quick start.
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        layer_types=("kda", "kda", "kda", "mla"),
        intermediate_size=192,
        kda_num_heads=2,
        kda_head_dim=32,
        mla_num_heads=2,
        mla_kv_lora_rank=32,
        mla_qk_nope_head_dim=16,
        mla_qk_shared_head_dim=16,
        mla_v_head_dim=32,
        residual="attnres",
    ),
    # The 13-layer scaled configuration (hidden 1024, 8 heads of 128 for both mixers).
    "k3-scaled": dict(
        vocab_size=8192,
        hidden_size=1024,
        layer_types=_k3_layer_types(),
        intermediate_size=2816,
        kda_num_heads=8,
        kda_head_dim=128,
        mla_num_heads=8,
        mla_kv_lora_rank=256,
        mla_qk_nope_head_dim=96,
        mla_qk_shared_head_dim=32,
        mla_v_head_dim=128,
        residual="attnres",
    ),
}
# The full-attention baseline of the Kimi Linear report: every layer Gated MLA, same sizes.
PRESETS["k3-scaled-all-mla"] = dict(PRESETS["k3-scaled"], layer_types=_k3_layer_types(all_mla=True))
# Block AttnRes at about 8 blocks over the depth, the granularity the AttnRes paper recommends: blocks of two
# decoder layers (4 sublayers), so 7 blocks over the 26 sublayers and, with the embedding, 8 block sums at the end.
PRESETS["k3-scaled-block"] = dict(PRESETS["k3-scaled"], residual="block_attnres", attnres_block_size=4)


@dataclass
class HybridConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    layer_types: tuple[str, ...] = ("kda", "kda", "kda", "mla")
    intermediate_size: int = 192
    residual: str = "attnres"
    attnres_block_size: int = 2  # sublayers per block (attention and MLP count separately); block_attnres only
    attnres_backend: str = "auto"  # "auto" (fused Triton ops on CUDA), "triton" or "torch" (the references)
    norm_eps: float = 1e-6
    # KDA mixer
    kda_num_heads: int = 2
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_lower_bound: float = -5.0  # the "bounded" gate's
    kda_backend: str = "auto"
    kda_gate: str = "bounded"  # the decay gate: "bounded", "softplus" or "head" (see ops/kda/gate.py)
    # Gated MLA mixer (NoPE)
    mla_num_heads: int = 2
    mla_kv_lora_rank: int = 32
    mla_qk_nope_head_dim: int = 16
    mla_qk_shared_head_dim: int = 16
    mla_v_head_dim: int = 32
    mla_q_lora_rank: int | None = None
    mla_output_gate: bool = True  # the sigmoid gate on the heads (False: plain MLA with NoPE, as in Kimi Linear)
    # Embeddings and init
    tie_embeddings: bool = False
    init_std: float = 0.02
    num_layers: int = field(init=False)

    def __post_init__(self):
        self.layer_types = tuple(self.layer_types)
        self.num_layers = len(self.layer_types)
        if self.num_layers == 0:
            raise ValueError("HybridConfig: layer_types is empty; expected at least one of 'kda' or 'mla'")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"HybridConfig: layer_types[{i}] = {kind!r}; expected one of {LAYER_TYPES}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"HybridConfig: residual={self.residual!r}; expected one of {RESIDUALS}")
        if self.attnres_backend not in ATTNRES_BACKENDS:
            raise ValueError(
                f"HybridConfig: attnres_backend={self.attnres_backend!r}; expected one of {ATTNRES_BACKENDS}"
            )
        if self.kda_backend not in KDA_BACKENDS:
            raise ValueError(f"HybridConfig: kda_backend={self.kda_backend!r}; expected one of {KDA_BACKENDS}")
        positive = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "attnres_block_size",
            "kda_num_heads",
            "kda_head_dim",
            "kda_conv_size",
            "mla_num_heads",
            "mla_kv_lora_rank",
            "mla_qk_nope_head_dim",
            "mla_v_head_dim",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HybridConfig: {name}={value!r}; expected a positive integer")
        if not isinstance(self.mla_qk_shared_head_dim, int) or self.mla_qk_shared_head_dim < 0:
            raise ValueError(f"HybridConfig: mla_qk_shared_head_dim={self.mla_qk_shared_head_dim!r}; expected >= 0")
        if self.mla_q_lora_rank is not None and (not isinstance(self.mla_q_lora_rank, int) or self.mla_q_lora_rank < 1):
            raise ValueError(f"HybridConfig: mla_q_lora_rank={self.mla_q_lora_rank!r}; expected None or >= 1")
        if self.kda_gate not in GATE_FORMS:
            raise ValueError(f"HybridConfig: kda_gate={self.kda_gate!r}; expected one of {GATE_FORMS}")
        if not isinstance(self.mla_output_gate, bool):
            raise ValueError(f"HybridConfig: mla_output_gate={self.mla_output_gate!r}; expected True or False")
        check_lower_bound(self.kda_lower_bound, name="HybridConfig: kda_lower_bound")
        if not self.norm_eps > 0:
            raise ValueError(f"HybridConfig: norm_eps={self.norm_eps}; expected > 0")
        if not self.init_std > 0:
            raise ValueError(f"HybridConfig: init_std={self.init_std}; expected > 0")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> HybridConfig:
        """A named preset (see `PRESETS`: "tiny", "k3-scaled", "k3-scaled-all-mla", "k3-scaled-block") with keyword
        overrides of any field."""
        if name not in PRESETS:
            raise ValueError(f"HybridConfig: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (derived ones left out)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        """Inverse of `to_dict`; unknown keys raise ValueError."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - known - {"num_layers"})
        if unknown:
            raise ValueError(f"HybridConfig: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, vocab]; None from forward(..., return_logits=False)
    loss: torch.Tensor | None = None  # scalar, float32 (float64 for float64 models); None without labels


class DecoderLayer(nn.Module):
    """Pre-norm [mixer, SwiGLU MLP]. With AttnRes, each sublayer also owns the AttnRes that builds its input."""

    def __init__(self, config: HybridConfig, layer_type: str):
        super().__init__()
        c = config
        self.layer_type = layer_type
        self.mixer_norm = RMSNorm(c.hidden_size, c.norm_eps)
        if layer_type == "kda":
            self.mixer = KimiDeltaAttention(
                c.hidden_size,
                c.kda_num_heads,
                head_dim=c.kda_head_dim,
                conv_size=c.kda_conv_size,
                lower_bound=c.kda_lower_bound,
                norm_eps=c.norm_eps,
                backend=c.kda_backend,
                gate=c.kda_gate,
            )
        else:
            self.mixer = GatedMLA(
                c.hidden_size,
                c.mla_num_heads,
                kv_lora_rank=c.mla_kv_lora_rank,
                qk_nope_head_dim=c.mla_qk_nope_head_dim,
                qk_shared_head_dim=c.mla_qk_shared_head_dim,
                v_head_dim=c.mla_v_head_dim,
                q_lora_rank=c.mla_q_lora_rank,
                norm_eps=c.norm_eps,
                output_gate=c.mla_output_gate,
            )
        self.mlp_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        if c.residual != "standard":
            self.mixer_res = AttnRes(c.hidden_size, eps=c.norm_eps)
            self.mlp_res = AttnRes(c.hidden_size, eps=c.norm_eps)

    def normed_sublayers(self, cache, decode: PackedProjections | None = None) -> list[tuple[Any, RMSNorm, Any]]:
        """[(attn_res or None, pre_norm, g)] for the two sublayers: sublayer(h) = g(pre_norm(h)). `decode`: a
        decode step's packed projections, handed to the mixer and the MLP."""
        mixer = lambda x: self.mixer(x, cache=cache, decode=decode)
        mlp = lambda x: self.mlp(x, decode=decode)
        return [
            (getattr(self, "mixer_res", None), self.mixer_norm, mixer),
            (getattr(self, "mlp_res", None), self.mlp_norm, mlp),
        ]

    def sublayers(self, cache, decode: PackedProjections | None = None) -> list[tuple[Any, Any]]:
        """[(attn_res or None, f)] for the two sublayers, f(h) = Sublayer(PreNorm(h))."""
        return [(res, lambda h, norm=norm, g=g: g(norm(h))) for res, norm, g in self.normed_sublayers(cache, decode)]


class HybridLM(nn.Module):
    check_token_ids: bool = False  # True: check token ids on every device, at one host sync per forward

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        if config.residual != "standard":
            self.final_res = AttnRes(config.hidden_size, eps=config.norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self) -> None:
        # Only the plain projections and the embedding: layers keep their own special inits (gate, conv, AttnRes).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    # ----------------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        *,
        return_logits: bool = True,
        decode: PackedProjections | None = None,
    ) -> ModelOutput:
        """input_ids [B, T] -> logits [B, T, vocab]; loss predicts labels[:, 1:] from positions [:, :-1] (-100 ignored).

        The loss comes from the hidden states by `ops.cross_entropy.linear_cross_entropy` (the head applied over
        token chunks), never from the returned logits. `return_logits=False` skips the head otherwise: `.logits` is
        None, and a training step (`model(ids, labels=ids, return_logits=False).loss`) neither computes nor keeps
        [B, T, vocab] logits. The loss is the mean over the labelled positions, and 0 (with zero gradients) when
        there are none (T = 1, or every label -100). With `cache`, the tokens are appended after the ones already in
        it and the cache is updated in place. Token ids are checked against the vocabulary when they are on the CPU
        (no device sync), and on every device when `check_token_ids` is set (one sync per call). `decode`: a decode
        step's packed projections (`graphs.DecodeStep` passes them), with which every layer and the head compute
        their products (layers/packed.py).
        """
        self._check_inputs(input_ids, labels, cache)
        if cache is not None:
            # The lengths count these tokens from here on (in place on the device, graph-safe): every MLA layer
            # writes its rows at the last T positions and attends up to the lengths (layers/seqlens.py).
            cache.advance(input_ids.shape[1])
        layer_caches = cache.layers if cache is not None else [None] * len(self.layers)
        h = self.embed(input_ids)
        residual = self.config.residual
        if residual == "attnres" and not torch.is_grad_enabled():
            h_out = self._attnres_inference(h, layer_caches, decode)  # already through the output norm
        elif residual != "standard" and self._fused_attnres(h):
            steps = self._normed_sublayers(layer_caches, decode)
            steps.append((self.final_res, self.norm, None))
            if residual == "attnres":
                h_out = attn_res_stream(h, steps)  # already through the output norm
            else:
                h_out = block_attn_res_stream(h, steps, self.config.attnres_block_size)
        else:
            sublayers = [
                s for layer, lc in zip(self.layers, layer_caches, strict=True) for s in layer.sublayers(lc, decode)
            ]
            if residual == "standard":
                for _, f in sublayers:
                    h = h + f(h)
            elif residual == "attnres":
                sources = [h]
                for res, f in sublayers:
                    sources.append(f(res(sources)))
                h = self.final_res(sources)
            else:
                h = self._block_attnres(h, sublayers)
            h_out = self.norm(h)
        loss = None
        if labels is not None:
            # Position t predicts labels[t + 1]; the last position predicts nothing. Shifting the labels instead of
            # slicing h keeps h_out a view (no [B, T - 1, D] copy).
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()  # (B * T)
            loss = linear_cross_entropy(h_out.flatten(0, 1), self.lm_head.weight, targets)
            # Nothing labelled: 0 instead of the op's 0 / 0 (the where also gives zero gradients, no host sync).
            loss = torch.where((targets != -100).any(), loss, torch.zeros_like(loss))
        logits = linear(self.lm_head, h_out, decode) if return_logits else None
        return ModelOutput(logits=logits, loss=loss)

    def _attnres_inference(self, embedding: torch.Tensor, layer_caches, decode=None) -> torch.Tensor:
        """Full AttnRes without autograd (inference, decoding): the same function as the list path, but the sources
        live in one preallocated [S, B, T, D] buffer (each written once, by the AttnRes that first reads it, never
        restacked) and every AttnRes is fused with the RMSNorm that reads it (`attn_res_norm`: one Triton kernel on
        CUDA). Returns FinalNorm(h_final)."""
        steps = self._normed_sublayers(layer_caches, decode)
        steps.append((self.final_res, self.norm, None))
        sources = embedding.new_empty(len(steps), *embedding.shape)  # (S, B, T, D)
        latest = embedding  # the newest source, stored into its slot by the next AttnRes (no separate copy)
        for i, (res, norm, g) in enumerate(steps, start=1):
            x = attn_res_norm(
                sources[:i],
                res.query,
                res.key_norm.weight,
                res.eps,
                norm_weight=norm.weight,
                norm_eps=norm.eps,
                latest=latest,
                backend="torch" if self.config.attnres_backend == "torch" else "auto",
            )
            if g is None:
                return x
            latest = g(x).to(sources.dtype)  # a no-op unless autocast made the sublayer output lower precision

    def _normed_sublayers(self, layer_caches, decode) -> list[tuple[Any, RMSNorm, Any]]:
        """(attn_res, pre_norm, g) of every sublayer, in order (`DecoderLayer.normed_sublayers`)."""
        pairs = zip(self.layers, layer_caches, strict=True)
        return [step for layer, cache in pairs for step in layer.normed_sublayers(cache, decode)]

    def _fused_attnres(self, embedding: torch.Tensor) -> bool:
        """Whether AttnRes runs through the fused differentiable ops (`config.attnres_backend`, see the module)."""
        backend = self.config.attnres_backend
        if backend == "triton" and not fused_train_supported(embedding):
            raise ValueError(
                f"HybridLM: attnres_backend='triton' needs triton and CUDA tensors (or CPU with TRITON_INTERPRET=1) "
                f"of a supported dtype; got {embedding.dtype} on {embedding.device}; use 'auto' or 'torch'"
            )
        return backend == "triton" or (backend == "auto" and use_triton(embedding) and fused_train_supported(embedding))

    def _block_attnres(self, embedding: torch.Tensor, sublayers) -> torch.Tensor:
        # The readable list path: sublayer i attends over the completed block sums b_0 = embedding, b_1, ... and,
        # unless it opens a block, the partial sum of its own block (docs/math.md). Block size 1 is Full AttnRes.
        size = self.config.attnres_block_size
        blocks, partial = [embedding], None
        for i, (res, f) in enumerate(sublayers):
            if i % size == 0 and partial is not None:
                blocks.append(partial)
                partial = None
            y = f(res(blocks if partial is None else [*blocks, partial]))
            partial = y if partial is None else partial + y
        return self.final_res(blocks if partial is None else [*blocks, partial])

    def _check_inputs(self, input_ids, labels, cache) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"HybridLM: input_ids must be an integer tensor [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("HybridLM: input_ids is empty (T = 0); expected at least one token")
        # An id out of range is an IndexError on the CPU, a device-side assert (CUDA unusable afterwards) on a GPU.
        if (input_ids.device.type == "cpu" or self.check_token_ids) and not torch.compiler.is_compiling():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"HybridLM: token ids must be in [0, {self.config.vocab_size}), got [{lo}, {hi}]")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"HybridLM: labels shape {tuple(labels.shape)} != input_ids {tuple(input_ids.shape)}")
        if cache is not None:
            if cache.batch_size != input_ids.shape[0]:
                raise ValueError(
                    f"HybridLM: cache holds batch size {cache.batch_size}, input has {input_ids.shape[0]} sequences"
                )
            if cache.seq_len + input_ids.shape[1] > cache.max_seq_len:
                raise ValueError(
                    f"HybridLM: {input_ids.shape[1]} new tokens after {cache.seq_len} cached exceed the cache's "
                    f"max_seq_len {cache.max_seq_len}"
                )

    # ------------------------------------------------------------------------------------------------------- cache
    def make_cache(self, batch_size: int, max_seq_len: int) -> HybridCache:
        """An empty cache for `batch_size` sequences of up to `max_seq_len` tokens, on the model's device and dtype."""
        if not all(is_int(n) for n in (batch_size, max_seq_len)):
            raise ValueError(f"make_cache: batch_size={batch_size!r}, max_seq_len={max_seq_len!r}; expected integers")
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"make_cache: batch_size={batch_size}, max_seq_len={max_seq_len}; expected both >= 1")
        seqlens = SeqLens(batch_size, max_seq_len, device=self.embed.weight.device)
        layers = []
        for layer in self.layers:
            if layer.layer_type == "kda":
                layers.append(layer.mixer.empty_cache(batch_size))
            else:
                layers.append(layer.mixer.empty_cache(batch_size, max_seq_len, seqlens=seqlens))
        return HybridCache(layers, seqlens)

    # ------------------------------------------------------------------------------------------------- accounting
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def layer_table(self) -> list[dict[str, Any]]:
        """One row per decoder layer: 1-based index, mixer type and parameter count (norms and AttnRes included)."""
        return [
            {"index": i + 1, "type": layer.layer_type, "parameters": sum(p.numel() for p in layer.parameters())}
            for i, layer in enumerate(self.layers)
        ]

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of MLA latent cache ([c ; k_s] rows) per token of context, summed over layers."""
        c = self.config
        itemsize = torch.empty((), dtype=dtype).element_size()
        num_mla = sum(kind == "mla" for kind in c.layer_types)
        return num_mla * (c.mla_kv_lora_rank + c.mla_qk_shared_head_dim) * itemsize

    def state_bytes_per_sequence(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of the constant per-sequence KDA state: float32 recurrent state plus conv tails, summed over layers."""
        c = self.config
        itemsize = torch.empty((), dtype=dtype).element_size()
        num_kda = sum(kind == "kda" for kind in c.layer_types)
        width = c.kda_num_heads * c.kda_head_dim
        recurrent = c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * 4
        conv = 3 * width * (c.kda_conv_size - 1) * itemsize
        return num_kda * (recurrent + conv)
