"""A corpus of documents in two splits (`Corpus`), and the rule that splits named documents by a hash of their name
(docs/training.md, "Training data").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

VAL_FRACTION = 0.05


@dataclass
class Corpus:
    """Documents of the two splits and a short description of where they came from."""

    train: list[str]
    val: list[str]
    source: str
    train_names: list[str] = field(default_factory=list)  # document names (relative paths) when there are any
    val_names: list[str] = field(default_factory=list)

    @property
    def num_bytes(self) -> tuple[int, int]:
        """UTF-8 bytes of (train, val)."""
        return _utf8_len(self.train), _utf8_len(self.val)

    def digest(self) -> str:
        """sha256 (hex) of the documents of both splits, in order, with their lengths: equal digests mean equal
        token streams under any tokenizer."""
        h = hashlib.sha256()
        for split, docs in ((b"train", self.train), (b"val", self.val)):
            h.update(split + len(docs).to_bytes(8, "little"))
            for doc in docs:
                data = doc.encode("utf-8")
                h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()


def _utf8_len(docs: list[str]) -> int:
    return sum(len(d.encode("utf-8")) for d in docs)


def name_hash(name: str) -> float:
    """A stable number in [0, 1) for a document name (sha256, not Python's salted hash())."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def in_validation(name: str, val_fraction: float = VAL_FRACTION) -> bool:
    """Whether the document called `name` belongs to the validation split."""
    return name_hash(name) < val_fraction
