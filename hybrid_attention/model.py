"""The hybrid decoder: embedding -> residual stream of [mixer, SwiGLU MLP] sublayers (KDA and Gated MLA in a 3:1
pattern, `layers/stream.py`) -> final norm -> LM head. `HybridConfig` lives in config.py; docs/inference.md and
docs/training.md say how it runs."""

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
from hybrid_attention.layers.attnres import AttnRes
from hybrid_attention.layers.documents import PackedDocuments
from hybrid_attention.layers.kda import KimiDeltaAttention
from hybrid_attention.layers.mla import GatedMLA
from hybrid_attention.layers.mlp import SwiGLU
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.packed import PackedProjections, linear
from hybrid_attention.layers.seqlens import SeqLens
from hybrid_attention.layers.stream import Step, residual_stream
from hybrid_attention.machine import check_fits
from hybrid_attention.ops.cross_entropy import linear_cross_entropy


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, vocab]; None from forward(..., return_logits=False)
    loss: torch.Tensor | None = None  # scalar, float32 (float64 for float64 models); None without labels


class DecoderLayer(nn.Module):
    """Pre-norm [mixer, SwiGLU MLP]. With AttnRes, each sublayer also owns the AttnRes that builds its input."""

    def __init__(self, config: HybridConfig, layer_type: str, *, first: bool = False, kda_backend: str = "auto"):
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
                rope_theta=c.mla_rope_theta if c.mla_rope else None,
            )
        self.mlp_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        if c.residual != "standard":
            if not first:  # the first sublayer reads the embedding alone, where an AttnRes is the identity
                self.mixer_res = AttnRes(c.hidden_size, eps=c.norm_eps)
            self.mlp_res = AttnRes(c.hidden_size, eps=c.norm_eps)

    def steps(self, cache, decode: PackedProjections | None = None, docs: PackedDocuments | None = None) -> list[Step]:
        """The two sublayers as residual-stream steps (attn_res or None, pre_norm, g), sublayer(h) = g(pre_norm(h)).
        `decode`: a decode step's packed projections, handed to the mixer and the MLP; `docs`: packed documents, to
        the mixer."""
        mixer = lambda x: self.mixer(x, cache=cache, decode=decode, cu_seqlens=docs)
        mlp = lambda x: self.mlp(x, decode=decode)
        return [
            (getattr(self, "mixer_res", None), self.mixer_norm, mixer),
            (getattr(self, "mlp_res", None), self.mlp_norm, mlp),
        ]


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
        self.layers = nn.ModuleList(
            DecoderLayer(config, kind, first=i == 0, kda_backend=kda_backend)
            for i, kind in enumerate(config.layer_types)
        )
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
        cu_seqlens: torch.Tensor | None = None,
        return_logits: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        decode: PackedProjections | None = None,
    ) -> ModelOutput:
        """input_ids [B, T] -> logits [B, T, vocab]; loss predicts labels[:, 1:] from positions [:, :-1] (-100 ignored).

        The loss comes from the hidden states by `ops.cross_entropy.linear_cross_entropy` (the head applied over
        token chunks), never from the returned logits. `return_logits=False` skips the head otherwise: `.logits` is
        None, and a training step (`model(ids, labels=ids, return_logits=False).loss`) neither computes nor keeps
        [B, T, vocab] logits. `logits_to_keep=n > 0`: the logits of the last n positions only, [B, n, vocab] (a
        prefill needs the last one's alone); a 1-D integer tensor of positions: the logits there, [B, n, vocab] (the
        last token of each packed document). The loss is the mean over the labelled positions, and 0 (with zero
        gradients) when there are none (T = 1, or every label -100). With `cache`, the tokens are appended after the
        ones already in it and the cache is updated in place. Token ids are checked against the vocabulary when they
        are on the CPU (no device sync), and on every device when `check_token_ids` is set (one sync per call).
        `decode`: packed projections (layers/packed.py), with which every layer and the head compute their products:
        a decode step's (`graphs.DecodeStep` passes them), or the serving engine's for its prefill chunks (fewer,
        larger products; the same values).

        `cu_seqlens` (int [N + 1], any device; a CPU one costs no device sync): input_ids [1, T] packs N documents
        back to back, as FLA's varlen API takes them. Each is its own sequence: KDA state and conv tails start from
        zeros at its first token, MLA attends within it, and the loss skips the position that would predict the
        next document's first token, so logits and loss are those of each document run alone. With a cache, the
        cache must take packed documents (`inference.packed_prefill.PackedPrefill`: the first chunks of several
        sequences, each written into its own slot).
        """
        packs = getattr(cache, "packs_documents", False)
        self._check_inputs(input_ids, labels, None if packs else cache)
        self._check_logits_to_keep(logits_to_keep, input_ids.shape[1])
        docs = None
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1 or (cache is not None and not packs):
                raise ValueError(
                    f"HybridLM: cu_seqlens packs documents into input_ids [1, T] without a cache (or with a cache "
                    f"that takes packed documents), got {tuple(input_ids.shape)}"
                    f"{' and a cache' if cache is not None else ''}"
                )
            docs = PackedDocuments.of(cu_seqlens, input_ids.shape[1], input_ids.device)
            if packs:
                cache.check_documents(docs)
        elif packs:
            raise ValueError("HybridLM: a cache that takes packed documents needs cu_seqlens")
        if cache is not None and not packs:
            # The lengths count these tokens from here on (in place on the device, graph-safe): every MLA layer
            # writes its rows at the last T positions and attends up to the lengths (layers/seqlens.py).
            cache.advance(input_ids.shape[1])
        layer_caches = cache.layers if cache is not None else [None] * len(self.layers)
        pairs = zip(self.layers, layer_caches, strict=True)
        steps = [step for layer, lc in pairs for step in layer.steps(lc, decode, docs)]
        steps.append((getattr(self, "final_res", None), self.norm, None))
        c = self.config
        h_out = residual_stream(
            c.residual, self.embed(input_ids), steps, block_size=c.attnres_block_size, backend=self.attnres_backend
        )
        loss = None
        if labels is not None:
            # Position t predicts labels[t + 1]; the last position predicts nothing. Shifting the labels instead of
            # slicing h keeps h_out a view (no [B, T - 1, D] copy).
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()  # (B * T)
            if docs is not None:  # the last token of a document predicts nothing
                last = (docs.cu_seqlens[1:-1].long() - 1) % targets.numel()  # an empty first document: the end
                targets = targets.index_fill(0, last, -100)
            loss = linear_cross_entropy(h_out.flatten(0, 1), self.lm_head.weight, targets)
            # Nothing labelled: 0 instead of the op's 0 / 0 (the where also gives zero gradients, no host sync).
            loss = torch.where((targets != -100).any(), loss, torch.zeros_like(loss))
        if isinstance(logits_to_keep, torch.Tensor):
            h_out = h_out.index_select(1, logits_to_keep.to(h_out.device))
        elif logits_to_keep:
            h_out = h_out[:, -logits_to_keep:]
        logits = linear(self.lm_head, h_out, decode) if return_logits else None
        return ModelOutput(logits=logits, loss=loss)

    @staticmethod
    def _check_logits_to_keep(keep, T: int) -> None:
        if isinstance(keep, torch.Tensor):
            if keep.dim() != 1 or keep.dtype not in (torch.int64, torch.int32) or keep.numel() == 0:
                raise ValueError(
                    f"HybridLM: logits_to_keep as a tensor must be 1-D integer positions, got {keep.dtype} "
                    f"{tuple(keep.shape)}"
                )
            if keep.device.type == "cpu" and not 0 <= int(keep.min()) <= int(keep.max()) < T:  # no sync elsewhere
                raise ValueError(f"HybridLM: logits_to_keep positions must lie in [0, {T}), got {keep.tolist()[:8]}")
        elif not is_int(keep) or keep < 0:
            raise ValueError(f"HybridLM: logits_to_keep={keep!r}; expected an integer >= 0 (0: all) or positions")

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
