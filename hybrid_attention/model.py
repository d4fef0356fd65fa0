"""The hybrid decoder: KDA and Gated MLA mixers in a 3:1 pattern, SwiGLU MLPs, and Attention Residuals.

`HybridConfig` (`config.py`) is one flat dataclass with named presets (`HybridConfig.from_preset("k3-scaled")`).
`HybridLM` is a pre-norm decoder: embedding -> blocks [mixer, MLP] -> final norm -> LM head. The residual stream is
wired by `config.residual`:

- "standard": h <- h + f(norm(h)) for every sublayer (attention and MLP are separate sublayers);
- "attnres": Full Attention Residuals: sublayer l reads a softmax-over-depth mix of the embedding and every earlier
  sublayer output (docs/math.md, "Attention Residuals"), and a final AttnRes mixes all sources before the output
  norm;
- "block_attnres": Block AttnRes: sublayers are grouped into blocks of `attnres_block_size` sublayers; inside a
  block the outputs are summed, across blocks a sublayer attends over the completed block sums and the partial sum
  of its own block.

`HybridLM(config, attnres_backend=...)` picks how AttnRes runs (the vocabulary of `ops.backends`): "auto" takes the
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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_attention.cache import HybridCache
from hybrid_attention.checks import is_int
from hybrid_attention.choices import ATTNRES_BACKENDS, KDA_BACKENDS
from hybrid_attention.config import HybridConfig
from hybrid_attention.layers.attnres import AttnRes, attn_res_stream, block_attn_res_stream
from hybrid_attention.layers.kda import KimiDeltaAttention
from hybrid_attention.layers.mla import GatedMLA
from hybrid_attention.layers.mlp import SwiGLU
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.packed import PackedProjections, linear
from hybrid_attention.layers.seqlens import SeqLens
from hybrid_attention.machine import check_fits
from hybrid_attention.ops.attnres.fused import attn_res_norm
from hybrid_attention.ops.attnres.rows import fused_train_supported
from hybrid_attention.ops.backends import use_triton
from hybrid_attention.ops.cross_entropy import linear_cross_entropy


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, vocab]; None from forward(..., return_logits=False)
    loss: torch.Tensor | None = None  # scalar, float32 (float64 for float64 models); None without labels


class DecoderLayer(nn.Module):
    """Pre-norm [mixer, SwiGLU MLP]. With AttnRes, each sublayer also owns the AttnRes that builds its input."""

    def __init__(self, config: HybridConfig, layer_type: str, *, kda_backend: str = "auto"):
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
                backend=kda_backend,
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

    def __init__(self, config: HybridConfig, *, kda_backend: str = "auto", attnres_backend: str = "auto"):
        """`kda_backend` (`choices.KDA_BACKENDS`) and `attnres_backend` (`choices.ATTNRES_BACKENDS`) choose the
        kernels, as transformers' `attn_implementation` does: how the model runs, not what it computes, so they are
        not part of `config` nor of a saved run."""
        super().__init__()
        for name, value, allowed in (
            ("kda_backend", kda_backend, KDA_BACKENDS),
            ("attnres_backend", attnres_backend, ATTNRES_BACKENDS),
        ):
            if value not in allowed:
                raise ValueError(f"HybridLM: {name}={value!r}; expected one of {allowed}")
        self.config = config
        self.kda_backend, self.attnres_backend = kda_backend, attnres_backend
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind, kda_backend=kda_backend) for kind in config.layer_types)
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
                backend="torch" if self.attnres_backend == "torch" else "auto",
            )
            if g is None:
                return x
            latest = g(x).to(sources.dtype)  # a no-op unless autocast made the sublayer output lower precision

    def _normed_sublayers(self, layer_caches, decode) -> list[tuple[Any, RMSNorm, Any]]:
        """(attn_res, pre_norm, g) of every sublayer, in order (`DecoderLayer.normed_sublayers`)."""
        pairs = zip(self.layers, layer_caches, strict=True)
        return [step for layer, cache in pairs for step in layer.normed_sublayers(cache, decode)]

    def _fused_attnres(self, embedding: torch.Tensor) -> bool:
        """Whether AttnRes runs through the fused differentiable ops (`attnres_backend`, see the module)."""
        backend = self.attnres_backend
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
        weight = self.embed.weight
        rows = batch_size * max_seq_len * self.cache_bytes_per_token(weight.dtype)  # the MLA rows, preallocated
        check_fits(rows, f"a cache for {batch_size:,} x {max_seq_len:,} tokens", weight.device)
        seqlens = SeqLens(batch_size, max_seq_len, device=weight.device)
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
