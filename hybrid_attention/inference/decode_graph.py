"""A whole-model decode step (embedding -> logits) over a static cache, captured once in a CUDA graph and replayed
(docs/inference.md, "CUDA graphs").
"""

from __future__ import annotations

import torch

from hybrid_attention.cache import HybridCache
from hybrid_attention.layers.packed import PackedProjections
from hybrid_attention.ops.cuda_graph import CapturedGraph


class DecodeStep:
    """One decoding step of `model` for the `B` sequences of `cache`: tokens [B] -> logits [B, vocab].

    Args:
        model: a `HybridLM` (inference: its weights must not change while this step is used).
        cache: the static cache it decodes into, empty or already prefilled: the warm-up and capture write into it
            and it is restored afterwards (`HybridCache.snapshot`), so building the step changes nothing. The
            serving engine passes a `PagedBatch` (inference/paged_cache.py), which offers the same methods.
        cuda_graph: capture the step in a CUDA graph (CUDA models only); False runs the same step eagerly.
        warmup_steps: eager steps run before capture.
        pack_projections: run each layer's input projections as one product from packed weight copies (one more
            copy of those weights in memory; `layers.packed`). The parameters themselves are not touched.
        gemv: the backend of the step's products with packed projections ("auto": the decode GEMV kernel of
            `ops.gemv` on CUDA, "torch": F.linear, "triton": that kernel also on CPU under the interpreter).
        packed: packed projections of `model` to use instead of making new ones (steps of one model at several
            batch sizes share one copy); pack_projections and gemv are then not read.

    The logits returned by a graph replay live in a static buffer that the next call overwrites.
    """

    def __init__(
        self,
        model,
        cache: HybridCache,
        *,
        cuda_graph: bool,
        warmup_steps: int = 2,
        pack_projections: bool = True,
        gemv: str = "auto",
        packed: PackedProjections | None = None,
    ):
        device = model.embed.weight.device
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"DecodeStep: cuda_graph=True needs a model on a CUDA device, got {device}")
        if cache.device != device:
            raise ValueError(f"DecodeStep: the cache is on {cache.device} but the model is on {device}")
        self.model = model
        self.cache = cache
        self.cuda_graph = cuda_graph
        self.tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)  # static input
        self.logits: torch.Tensor | None = None  # static output of the graph
        self.graph: CapturedGraph | None = None
        # Kept alive here: a captured graph reads these copies.
        if packed is None and pack_projections:
            packed = PackedProjections(model, gemv)
        self.packed = packed
        if cuda_graph:
            room = cache.max_seq_len - cache.seq_len
            if room < 1:
                raise ValueError(
                    f"DecodeStep: the cache is full ({cache.seq_len} of max_seq_len {cache.max_seq_len} tokens); "
                    "capturing a step needs room for one more token"
                )
            self._capture(max(1, min(warmup_steps, room)))

    @torch.no_grad()
    def _capture(self, warmup_steps: int) -> None:
        model, cache = self.model, self.cache
        saved = cache.snapshot()
        try:
            step = lambda: model(self.tokens, cache=cache, decode=self.packed).logits[:, -1]  # (B, vocab)
            reset = lambda: cache.restore(saved)
            self.graph = CapturedGraph(step, self.tokens.device, warmup_steps=warmup_steps, reset=reset)
            self.logits = self.graph.output
        finally:
            # Warm-up really ran; capture only recorded (but advanced the host counts once): back to the snapshot.
            torch.cuda.current_stream(self.tokens.device).synchronize()
            cache.restore(saved)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one new token per sequence) -> logits [B, vocab] for the next position; the cache advances."""
        cache = self.cache
        if tokens.shape != (cache.batch_size,):
            raise ValueError(f"DecodeStep: expected tokens of shape [{cache.batch_size}], got {tuple(tokens.shape)}")
        if cache.seq_len + 1 > cache.max_seq_len:
            raise ValueError(
                f"DecodeStep: the cache is full ({cache.seq_len} of max_seq_len {cache.max_seq_len} tokens)"
            )
        self.tokens[:, 0].copy_(tokens)
        if self.graph is None:
            return self.model(self.tokens, cache=cache, decode=self.packed).logits[:, -1]
        self.replay()
        return self.logits

    def replay(self) -> None:
        """Replay the captured step on whatever the token buffer holds (benchmarks); advances the host counts."""
        if self.graph is None:
            raise ValueError("DecodeStep.replay: no CUDA graph was captured (cuda_graph=False)")
        if self.cache.seq_len + 1 > self.cache.max_seq_len:
            raise ValueError(f"DecodeStep.replay: the cache is full (max_seq_len {self.cache.max_seq_len} tokens)")
        self.graph.replay()
        self.cache.advance(1, on_device=False)  # the graph advanced the device lengths
