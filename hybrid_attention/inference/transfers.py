"""Host <-> device copies that never make the host wait for the GPU (through pinned memory, which torch's caching
host allocator keeps from reuse until the copies queued on it have run), so the serving loop prepares the next
step while the current one runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A device tensor holding `values`, queued behind the stream's work instead of waiting for it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on the host, copied asynchronously: `values()` waits for the copy (and the work
    queued before it) only when called."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda":
            self._host, self._event = tensor.detach().cpu(), None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def values(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
