"""`CapturedGraph`: one call of a function, warmed up on a side stream and captured in a CUDA graph, together with
what its replays read outside their memory pool (the ops' pointer tables); training and decoding both use it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from hybrid_attention.ops.attnres.rows import captured_tables


class CapturedGraph:
    """Capture `fn()` once: `warmup_steps` eager calls on a side stream (Triton compilation, cuBLAS handles, the
    allocator), `reset()` to undo what they changed, then one captured call whose result is `output`.

    `replay()` reruns the captured work on whatever the static inputs hold; `output` lives in the graph's memory and
    is overwritten by every replay; `kept` holds the ops' host-side state the replays read (AttnRes pointer tables).
    Keep this object as long as the graph is replayed."""

    def __init__(
        self,
        fn: Callable[[], Any],
        device: torch.device,
        *,
        warmup_steps: int = 2,
        reset: Callable[[], None] = lambda: None,
        warmup_context: Callable[[], Any] | None = None,
    ):
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side), (warmup_context or contextlib.nullcontext)():
            for _ in range(warmup_steps):
                fn()
        current.wait_stream(side)
        reset()
        self.graph = torch.cuda.CUDAGraph()
        with captured_tables() as self.kept, torch.cuda.graph(self.graph):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()
