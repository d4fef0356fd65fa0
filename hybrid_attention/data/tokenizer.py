"""Tokenizers: raw UTF-8 bytes (vocabulary 256) and a byte-level BPE trained with the `tokenizers` library, behind one
interface (docs/training.md, "Tokenizers").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BPE_FILE = "tokenizer.json"
DEFAULT_BPE_VOCAB = 8192
BPE_TRAIN_MAX_BYTES = 32_000_000  # a few thousand merges are settled well within this; training time grows with text
EOD_TOKEN = "<|endoftext|>"
EOD_NAMES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")  # how other tokenizers name theirs
BYTE_EOD = 0xFF  # never a byte of UTF-8 text


def byte_alphabet() -> dict[int, str]:
    """Byte value -> the printable character that stands for it in byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, a few more) are moved, in order,
    to code points 256 and up.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, byte 0xFF ending each document. Nothing to train or save.

    `eod_id=None`: the tokenizer of runs saved before the end-of-document id, which ends documents with a newline."""

    kind = "byte"
    vocab_size = 256

    def __init__(self, eod_id: int | None = BYTE_EOD):
        if eod_id not in (None, BYTE_EOD):
            raise ValueError(f"the byte tokenizer's end-of-document id is {BYTE_EOD} (or none), got {eod_id!r}")
        self.eod_id = eod_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def encode_packed(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each document's ids followed by its end (`eod_id`, or a newline) -> (ids [N] uint32, lengths [D] int64)."""
        end = b"\n" if self.eod_id is None else bytes([self.eod_id])
        data = [doc.encode("utf-8") + end for doc in docs]
        ids = np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.uint32)
        return ids, np.array([len(d) for d in data], dtype=np.int64)

    def encode_documents(self, docs: list[str]) -> torch.Tensor:
        """All documents, each followed by its end, as one int32 tensor [N]."""
        import torch  # here: the tokenize workers read no tensors

        return torch.from_numpy(self.encode_packed(docs)[0].astype(np.int32))

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == self.eod_id else bytes([token_id])

    def byte_lengths(self) -> torch.Tensor:
        import torch

        lengths = torch.ones(256, dtype=torch.long)
        if self.eod_id is not None:
            lengths[self.eod_id] = 0
        return lengths

    def identity(self) -> str:
        """What decides the ids: equal identities encode every text alike."""
        return f"byte eod={self.eod_id}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eod_id": self.eod_id}


class BPETokenizer:
    """Byte-level BPE (`tokenizers`), trained on the training split and saved as `tokenizer.json`."""

    kind = "bpe"

    def __init__(self, tok):
        self._tok = tok
        if hasattr(tok, "encode_special_tokens"):  # a document that spells "<|endoftext|>" is text, not its end
            tok.encode_special_tokens = True
        self.vocab_size = tok.get_vocab_size()
        specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        to_byte = {c: b for b, c in byte_alphabet().items()}
        table = [b""] * self.vocab_size
        for piece, i in tok.get_vocab().items():
            if i in specials:
                continue  # no text: an end of document prints nothing
            try:
                table[i] = bytes(to_byte[c] for c in piece)
            except KeyError:
                raise ValueError(
                    f"tokenizer: token {piece!r} is not in the byte-level alphabet (only byte-level BPE tokenizers, "
                    "as GPT-2's or the ones `train --tokenizer bpe` writes, are supported)"
                ) from None
        self._bytes = table
        self.eod_id = next((i for i, name in sorted(specials.items()) if name in EOD_NAMES), None)

    @classmethod
    def train(
        cls, docs: list[str], vocab_size: int = DEFAULT_BPE_VOCAB, *, max_bytes: int = BPE_TRAIN_MAX_BYTES
    ) -> BPETokenizer:
        """Train on `docs` (the training split), on its first documents up to `max_bytes` of text (at least one).
        The vocabulary starts from the 256 byte symbols."""
        if vocab_size < 256:
            raise ValueError(f"--vocab-size for a byte-level BPE must be at least 256, got {vocab_size}")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[EOD_TOKEN],  # id 0
            show_progress=False,
        )
        sample, size = [], 0
        for doc in docs:
            if sample and size + len(doc) > max_bytes:
                break
            sample.append(doc)
            size += len(doc)
        tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
        return cls(tok)

    def with_eod(self) -> BPETokenizer:
        """This tokenizer, or a copy with `<|endoftext|>` added as a special token (the last id) when it has no
        end-of-document token."""
        if self.eod_id is not None:
            return self
        from tokenizers import AddedToken, Tokenizer

        tok = Tokenizer.from_str(self.to_json())
        tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True)])
        return BPETokenizer(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer: {path} is missing")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"tokenizer: {path} is not a valid tokenizers file ({e})") from None

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return b"".join(self._bytes[int(i)] for i in ids).decode("utf-8", errors="replace")

    def encode_packed(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each document's ids followed by `eod_id` (a tokenizer without one: the document and a newline, encoded
        together) -> (ids [N] uint32, lengths [D] int64). Encoded in parallel by the tokenizers library."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no character offsets: faster
        if self.eod_id is None:
            parts = [np.asarray(e.ids, dtype=np.uint32) for e in encode([doc + "\n" for doc in docs])]
        else:
            eod = np.array([self.eod_id], dtype=np.uint32)
            parts = [np.concatenate([np.asarray(e.ids, dtype=np.uint32), eod]) for e in encode(docs)]
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)), lengths

    def encode_documents(self, docs: list[str]) -> torch.Tensor:
        """All documents, each followed by its end, as one int32 tensor [N] (encoded in parallel)."""
        import torch

        return torch.from_numpy(self.encode_packed(docs)[0].astype(np.int32))

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def byte_lengths(self) -> torch.Tensor:
        import torch

        return torch.tensor([len(b) for b in self._bytes], dtype=torch.long)

    def identity(self) -> str:
        """What decides the ids: equal identities encode every text alike."""
        return self.to_json()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "file": BPE_FILE, "eod_id": self.eod_id}


Tokenizer = ByteTokenizer | BPETokenizer


def tokenizer_from_dict(meta: dict, run_dir: str | Path) -> Tokenizer:
    """The tokenizer a run directory's config.json describes (`{"kind": "byte"}` or `{"kind": "bpe", ...}`)."""
    kind = meta.get("kind")
    if kind == "byte":
        return ByteTokenizer(meta.get("eod_id"))  # none in runs saved before it existed
    if kind == "bpe":
        name = meta.get("file", BPE_FILE)
        root = Path(run_dir).resolve()
        path = (root / name).resolve() if isinstance(name, str) else None
        if path is None or not path.is_relative_to(root):  # config.json is read from disk: it names no outside file
            raise ValueError(f"config.json: tokenizer file {name!r} must be a file inside the run directory {run_dir}")
        tok = BPETokenizer.load(path)
        if tok.vocab_size != meta.get("vocab_size", tok.vocab_size):
            raise ValueError(
                f"tokenizer: {run_dir}/{BPE_FILE} has {tok.vocab_size} tokens but config.json says {meta['vocab_size']}"
            )
        return tok
    raise ValueError(f"config.json: unknown tokenizer kind {kind!r}, expected 'byte' or 'bpe'")
