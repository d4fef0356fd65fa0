"""Plain files written whole or not at all, and JSON lines read back.

`atomic_write` fills a temporary file beside the target, fsyncs it, moves it over with os.replace and fsyncs the
directory: a stop at any moment leaves the old file or the new one. New files get open()'s permissions.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync(path: str | Path, *, directory: bool = False) -> None:
    """Flush a file's data to the disk, or a directory's entries (POSIX only), so that a rename in it survives a
    crash."""
    if directory and not hasattr(os, "O_DIRECTORY"):
        return  # a directory cannot be opened for fsync outside POSIX
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_permissions(path: str | Path) -> None:
    """0666 less the umask, as open() creates files (safetensors writes 0600, torch.save 0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` on a fresh temporary file beside `path`, then move it over `path` (and fsync the
    directory, so that the rename itself survives a crash)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        write(str(tmp))
        default_permissions(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent, directory=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_json_lines(path: str | Path) -> list:
    """The values of the JSON lines of `path` ([] when it does not exist). A last line without its newline (an append
    cut short) is dropped; any other line that is not JSON raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    values = []
    for number, line in enumerate(path.read_bytes().split(b"\n")[:-1], start=1):  # [-1]: after the last newline
        try:
            values.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: line {number} is not JSON ({e}); remove the line to continue") from None
    return values
