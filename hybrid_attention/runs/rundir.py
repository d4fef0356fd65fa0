"""What keeps a run directory one run: a single writer (`RunLock`) and the same data on every resume (the data
fingerprint); docs/training.md, "Run directories and checkpoints".
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch

LOCK = "lock"


class RunLock:
    """`with RunLock(run_dir):` holds the run directory for this process; a second holder gets a ValueError naming
    the first one's process id. The directory must exist."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # not POSIX: the directory stays unlocked
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"{self.path.parent} is in use by another training job ({holder}); wait for it to end or stop it, "
                "or choose another --out"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def data_fingerprint(train_tokens: torch.Tensor, val_tokens: torch.Tensor) -> dict:
    """{"train_tokens", "val_tokens", "sha256"} of the two token streams (1-D integer tensors on the CPU)."""
    digest = hashlib.sha256()
    for tokens in (train_tokens, val_tokens):
        digest.update(f"{tokens.numel()}:{tokens.dtype}:".encode())
        digest.update(tokens.contiguous().numpy())
    return {"train_tokens": train_tokens.numel(), "val_tokens": val_tokens.numel(), "sha256": digest.hexdigest()}


def check_fingerprint(saved, now: dict, source: str, where: str, legacy=None) -> None:
    """ValueError unless `saved` (config.json's "data_fingerprint", `where`; None for runs older than it) equals
    `now`, the fingerprint of the data `source` as read today. `legacy()`: the data's fingerprint in the form runs
    saved before shards (no "format" key) store, computed only for such a run."""
    if saved is None:
        return
    if isinstance(saved, dict) and "format" not in saved and "format" in now and legacy is not None:
        now = legacy()
    if not isinstance(saved, dict) or set(saved) != set(now) or not isinstance(saved["sha256"], str):
        raise ValueError(f"{where}: data_fingerprint is damaged; expected {sorted(now)}")
    if saved != now:
        raise ValueError(
            f"the data changed since the run started: {source} now gives {now['train_tokens']:,} / "
            f"{now['val_tokens']:,} train / validation tokens (sha256 {now['sha256'][:12]}), the run was trained on "
            f"{saved['train_tokens']:,} / {saved['val_tokens']:,} (sha256 {saved['sha256'][:12]}); resume with the "
            "same data, or start a new run"
        )
