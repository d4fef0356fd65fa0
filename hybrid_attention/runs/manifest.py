"""A checkpoint's manifest, `checkpoint.json`: what kind of checkpoint a step directory holds, its step, and the size
and SHA-256 of every file in it, checked before anything is read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hybrid_attention.files import atomic_write_text

MANIFEST = "checkpoint.json"
FORMAT = "hybrid-attention-checkpoint"
KINDS = ("single", "sharded")  # single: model.safetensors + train_state.pt; sharded: torch.distributed.checkpoint
_CHUNK = 1 << 22


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def write_manifest(directory: str | Path, *, kind: str, step: int) -> None:
    """Record every file of `directory` (sub-folders included) in directory/checkpoint.json."""
    if kind not in KINDS:
        raise ValueError(f"a checkpoint's kind is one of {KINDS}, got {kind!r}")
    directory = Path(directory)
    listed = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(directory).as_posix(): _entry(p) for p in listed}
    body = {"format": FORMAT, "version": 1, "kind": kind, "step": step, "files": entries}
    atomic_write_text(directory / MANIFEST, json.dumps(body, indent=1) + "\n")


def add_file(directory: str | Path, name: str) -> None:
    """Record one more file (written after the checkpoint was committed, e.g. an export's model.safetensors)."""
    directory = Path(directory)
    body = read_manifest(directory)
    if body is None:
        return  # an older checkpoint without a manifest stays without one
    body["files"][name] = _entry(directory / name)
    atomic_write_text(directory / MANIFEST, json.dumps(body, indent=1) + "\n")


def read_manifest(directory: str | Path) -> dict | None:
    """The checked manifest of a step directory, or None when it has none (checkpoints written before manifests)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}); the checkpoint is damaged") from None
    problem = None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        problem = f"its format is not {FORMAT!r}"
    elif body.get("kind") not in KINDS:
        problem = f"kind {body.get('kind')!r} is not one of {KINDS}"
    elif not isinstance(body.get("step"), int) or isinstance(body["step"], bool) or body["step"] < 0:
        problem = f"step {body.get('step')!r} is not an integer >= 0"
    elif not isinstance(body.get("files"), dict) or not all(_valid_entry(name, e) for name, e in body["files"].items()):
        problem = "its file list is not a map of relative names to {bytes, sha256}"
    if problem:
        raise ValueError(f"{path} is not a hybrid-attention checkpoint manifest: {problem}")
    return body


def _valid_entry(name, entry) -> bool:
    safe = isinstance(name, str) and name and not name.startswith("/") and ".." not in Path(name).parts
    return (
        safe
        and isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
        and len(entry["sha256"]) == 64
    )


def checkpoint_kind(directory: str | Path) -> str | None:
    """ "single" or "sharded" as the manifest declares, or None without a manifest."""
    body = read_manifest(directory)
    return None if body is None else body["kind"]


def verify(directory: str | Path, names: list[str] | None = None) -> None:
    """Check the listed files (all of the manifest's when None) against their recorded sizes and checksums.
    ValueError naming the first file that is missing or differs. Nothing is checked without a manifest."""
    directory = Path(directory)
    body = read_manifest(directory)
    if body is None:
        return
    recorded = body["files"]
    for name in recorded if names is None else names:
        if name not in recorded:
            raise ValueError(f"{directory}: {name} is not listed in its {MANIFEST}; the checkpoint is damaged")
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{directory}: {name} is missing; the checkpoint is damaged")
        size = path.stat().st_size
        if size != recorded[name]["bytes"]:
            raise ValueError(
                f"{path} has {size:,} bytes where its checkpoint recorded {recorded[name]['bytes']:,}: damaged"
            )
        if file_sha256(path) != recorded[name]["sha256"]:
            raise ValueError(f"{path} does not match the checksum its checkpoint recorded: the file is damaged")
