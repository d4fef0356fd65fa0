"""HybridCache: what a hybrid model keeps between decoding steps.

Per KDA layer a constant-size state (three conv tails and the float32 recurrent state, `KDACache`); per MLA layer the
latent rows `[c ; k_s]` (d_c + d_s numbers per token, `MLACache`). Layer caches are preallocated and updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


def _tensors(obj) -> list[torch.Tensor]:
    return [v for f in fields(obj) if isinstance(v := getattr(obj, f.name), torch.Tensor)]


@dataclass
class HybridCache:
    layers: list  # one KDACache or MLACache per decoder layer, in order
    batch_size: int
    max_seq_len: int
    seq_len: int = 0  # tokens appended so far (the same for every sequence of the batch)

    def nbytes(self) -> int:
        """Bytes held by every tensor of the cache (the preallocated MLA rows count in full)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in _tensors(layer))
