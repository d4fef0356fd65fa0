"""Device -> host copies that never make the host wait for the GPU until their values are needed, so the serving
loop prepares the next step while the current one runs (host -> device: `device.to_device`)."""

from __future__ import annotations

import torch


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

    def values(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
