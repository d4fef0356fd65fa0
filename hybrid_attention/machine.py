"""What this machine has: the memory of a device, and the one check that refuses a size it can never hold
(docs/training.md, "Sizes the machine cannot hold").
"""

from __future__ import annotations

from pathlib import Path

import torch

# Where a container's memory limit is written (cgroup v2, then v1); a process inside sees the host's RAM otherwise.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes(device: torch.device | str) -> int | None:
    """The memory a job on `device` can have, in bytes: a CUDA card's total; on the CPU what the kernel reports as
    available (free and reclaimable), capped by the container's limit. None where it is unknown (meta, non-Linux)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
    if "MemAvailable" not in fields:
        return None
    total = int(fields["MemAvailable"].split()[0]) * 1024
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def format_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as disks and datasheets count)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 999.5:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB" if n < 999.5 else f"{n:,.0f} PB"


def check_fits(nbytes: int, what: str, device: torch.device | str) -> None:
    """ValueError unless `nbytes` (a lower bound of what `what` needs on `device`) fits the device's memory.

    `what` is the subject of the sentence, e.g. "a step's 1,024 token ids (--grad-accum 1 x --batch-size 8 x ...)"."""
    total = memory_bytes(device)
    if total is None or nbytes <= total:
        return
    device = torch.device(device)
    where = "of memory free on this machine" if device.type == "cpu" else f"on the {torch.cuda.get_device_name(device)}"
    raise ValueError(f"{what} would need at least {format_bytes(nbytes)}, more than the {format_bytes(total)} {where}")
