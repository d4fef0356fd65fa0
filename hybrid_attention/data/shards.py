"""Tokenized shards: token ids and document offsets in safetensors files, an index.json over them, read in place
(docs/training.md, "Shards").
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid_attention.files import atomic_write, atomic_write_text

FORMAT = "hybrid-attention shards v1"
INDEX = "index.json"
SPLITS = ("train", "val")
_DTYPES = {"U16": np.uint16, "U32": np.uint32, "I64": np.int64}
_OPEN_SHARDS = 32  # open files kept per split; a corpus of thousands of shards must not run out of descriptors


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_shard(path: Path, ids: np.ndarray, lengths: np.ndarray, dtype: np.dtype) -> dict:
    """Write documents (ids [N], lengths [D] summing to N) as one shard, atomically; returns its index entry."""
    from safetensors.numpy import save_file

    if int(lengths.sum()) != ids.size:
        raise ValueError(f"write_shard: the document lengths sum to {int(lengths.sum())}, not to the {ids.size} ids")
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tensors = {"tokens": ids.astype(dtype, copy=False), "doc_offsets": offsets}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    return {
        "file": path.name,
        "num_tokens": int(ids.size),
        "num_documents": int(lengths.size),
        "bytes": path.stat().st_size,
        "sha256": file_sha256(path),
    }


def _layout(path: Path) -> dict[str, tuple[np.dtype, int, int]]:
    """{tensor name: (dtype, number of elements, byte offset of its data in the file)} from a safetensors header."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= 1 << 20:
            raise ValueError(f"{path} is not a shard: its safetensors header size is {size} bytes")
        header = json.loads(f.read(size))
    base = 8 + size
    out = {}
    for name in ("tokens", "doc_offsets"):
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES or len(entry.get("shape", ())) != 1:
            raise ValueError(f"{path} is not a shard: no 1-D {name!r} tensor of a known dtype")
        begin, _ = entry["data_offsets"]
        out[name] = (np.dtype(_DTYPES[entry["dtype"]]), int(entry["shape"][0]), base + int(begin))
    return out


class _Shard:
    """One open shard: its file descriptor for token reads and its document offsets, memory-mapped."""

    def __init__(self, path: Path, entry: dict):
        layout = _layout(path)
        self.dtype, n, self._token_at = layout["tokens"]
        _, num_offsets, offsets_at = layout["doc_offsets"]
        if n != entry["num_tokens"] or num_offsets != entry["num_documents"] + 1:
            raise ValueError(
                f"{path}: holds {n} tokens and {num_offsets - 1} documents, the index says {entry['num_tokens']} and "
                f"{entry['num_documents']}"
            )
        self.offsets = np.memmap(path, dtype=np.int64, mode="r", offset=offsets_at, shape=(num_offsets,))
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, start: int, end: int) -> np.ndarray:
        size = self.dtype.itemsize
        data = os.pread(self._fd, (end - start) * size, self._token_at + start * size)
        if len(data) != (end - start) * size:
            raise ValueError(f"a shard ended early: wanted tokens {start}:{end}, the file holds fewer")
        return np.frombuffer(data, dtype=self.dtype)

    def close(self) -> None:
        os.close(self._fd)
        self.offsets = None  # the map closes with its last reference


@dataclass
class ShardSet:
    """One split of a shard folder as a single stream of `num_tokens` token ids, read in place."""

    root: Path
    entries: list[dict]  # the index's shard entries of this split, in order

    def __post_init__(self):
        counts = [e["num_tokens"] for e in self.entries]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)  # [S + 1]
        self.num_tokens = int(self.starts[-1])
        self.num_documents = sum(e["num_documents"] for e in self.entries)
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        self._lock = threading.Lock()  # the loader's thread and the evaluation read one split together

    def numel(self) -> int:
        return self.num_tokens

    def _shard(self, i: int) -> _Shard:
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        shard = _Shard(self.root / self.entries[i]["file"], self.entries[i])
        self._open[i] = shard
        if len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return shard

    def _pieces(self, start: int, end: int):
        """(shard index, local start, local end, offset in the window) of the shards that [start, end) covers."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"tokens {start}:{end} are outside the split's {self.num_tokens}")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            local = start - int(self.starts[i])
            stop = min(end, int(self.starts[i + 1]))
            yield i, local, stop - int(self.starts[i]), start
            start, i = stop, i + 1

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split ([length], the shards' dtype)."""
        with self._lock:
            parts = [self._shard(i).read(a, b) for i, a, b, _ in self._pieces(start, start + length)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_starts(self, start: int, length: int) -> np.ndarray:
        """Positions p in (0, length) where a document starts at token start + p (int64, ascending)."""
        found = []
        with self._lock:
            for i, a, b, at in self._pieces(start, start + length):
                offsets = self._shard(i).offsets
                lo, hi = np.searchsorted(offsets, [a, b], side="left")
                found.append(np.array(offsets[lo:hi], dtype=np.int64) - a + (at - start))
        starts = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return starts[starts > 0]

    def windows(self, starts, length: int) -> np.ndarray:
        """Windows of `length` tokens at `starts` -> [len(starts), length] int64."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts):
            out[row] = self.read(int(start), length)
        return out

    def verify(self, shards: range | None = None, progress=None) -> None:
        """Check the size and SHA-256 of each shard (`shards`: their positions, default all) against the index;
        ValueError naming the first damaged one. `progress(nbytes)` is called after each."""
        for i in shards if shards is not None else range(len(self.entries)):
            entry = self.entries[i]
            path = self.root / entry["file"]
            if not path.is_file():
                raise ValueError(f"{path} is missing; the index of {self.root} lists it")
            size = path.stat().st_size
            digest = file_sha256(path) if size == entry["bytes"] else None
            if digest != entry["sha256"]:
                found = f"{size:,} bytes" if digest is None else f"SHA-256 {digest[:16]}"
                wanted = f"{entry['bytes']:,} bytes" if digest is None else entry["sha256"][:16]
                raise ValueError(
                    f"{path} is damaged ({found}, the index says {wanted}); nothing was trained on it. Tokenize the "
                    "source again into this folder (finished shards that check out are kept)"
                )
            if progress is not None:
                progress(size)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()


# ------------------------------------------------------------------------------------------------------ the index
def write_index(root: Path, index: dict) -> None:
    atomic_write_text(root / INDEX, json.dumps({"format": FORMAT, **index}, indent=1) + "\n")


def is_shard_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding a shard index (complete or not, `read_index` checks it)."""
    return (Path(path) / INDEX).is_file()


def read_index(root: str | Path) -> dict:
    """The checked index of a shard folder. ValueError when it is missing, damaged or of another format."""
    root = Path(root)
    path = root / INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{root} holds no {INDEX}: not a folder of shards from `hybrid-attention tokenize`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f'{path} was not written by `hybrid-attention tokenize` (no "format": "{FORMAT}")')
    for split in SPLITS:
        entries = index.get("splits", {}).get(split, {}).get("shards")
        if not isinstance(entries, list):
            raise ValueError(f"{path}: no shard list for the {split} split")
        for e in entries:
            ok = isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("sha256"), str)
            ok = ok and all(isinstance(e.get(k), int) and e[k] >= 0 for k in ("num_tokens", "num_documents", "bytes"))
            if not ok or Path(e["file"]).name != e["file"]:  # a plain file name inside the folder, nothing else
                raise ValueError(f"{path}: a {split} shard entry is damaged: {json.dumps(e)[:120]}")
    if not isinstance(index.get("tokenizer"), dict):
        raise ValueError(f"{path}: no tokenizer section")
    return index


def open_split(root: str | Path, index: dict, split: str) -> ShardSet:
    return ShardSet(Path(root), index["splits"][split]["shards"])


def fingerprint(index: dict) -> dict:
    """What identifies the token streams of a shard folder: the counts and a SHA-256 over the shards' own, in order
    (the shards are checked against theirs before a run reads them)."""
    h = hashlib.sha256(FORMAT.encode())
    counts = {}
    for split in SPLITS:
        entries = index["splits"][split]["shards"]
        counts[split] = sum(e["num_tokens"] for e in entries)
        for e in entries:
            h.update(f"{split}:{e['num_tokens']}:{e['sha256']}\n".encode())
    return {"format": "shards", "train_tokens": counts["train"], "val_tokens": counts["val"], "sha256": h.hexdigest()}
