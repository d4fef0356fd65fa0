"""Tokenizers: raw UTF-8 bytes (vocabulary 256) and a byte-level BPE trained with the `tokenizers` library.

Both expose the same small interface: `encode`, `decode`, `encode_documents` (a whole split as one id tensor),
`token_bytes` (the exact bytes of one id, so generated text can be streamed through an incremental UTF-8 decoder
even when a character spans several tokens) and `byte_lengths` (bytes per id, for bits per byte).

The BPE tokenizer uses the GPT-2 style byte-level alphabet: each of the 256 byte values is shown as one printable
character, so a token's string maps back to its bytes character by character.
"""

from __future__ import annotations

from pathlib import Path

import torch

BPE_FILE = "tokenizer.json"
DEFAULT_BPE_VOCAB = 8192
BPE_TRAIN_MAX_BYTES = 32_000_000  # a few thousand merges are settled well within this; training time grows with text


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
    """UTF-8 bytes as token ids 0..255. Nothing to train or save."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_documents(self, docs: list[str]) -> torch.Tensor:
        """All documents, each followed by a newline, as one int32 tensor [N]."""
        data = bytearray()
        for doc in docs:
            data += doc.encode("utf-8")
            data += b"\n"
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int32) if data else torch.zeros(0, dtype=torch.int32)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def byte_lengths(self) -> torch.Tensor:
        return torch.ones(256, dtype=torch.long)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}


class BPETokenizer:
    """Byte-level BPE (`tokenizers`), trained on the training split and saved as `tokenizer.json`."""

    kind = "bpe"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        to_byte = {c: b for b, c in byte_alphabet().items()}
        table = [b""] * self.vocab_size
        for piece, i in tok.get_vocab().items():
            try:
                table[i] = bytes(to_byte[c] for c in piece)
            except KeyError:
                raise ValueError(f"tokenizer: token {piece!r} is not in the byte-level alphabet") from None
        self._bytes = table

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
            special_tokens=[],
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

    def encode_documents(self, docs: list[str]) -> torch.Tensor:
        """All documents, each followed by a newline, as one int32 tensor [N] (encoded in parallel)."""
        encodings = self._tok.encode_batch([doc + "\n" for doc in docs])
        ids = [i for enc in encodings for i in enc.ids]
        return torch.tensor(ids, dtype=torch.int32)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def byte_lengths(self) -> torch.Tensor:
        return torch.tensor([len(b) for b in self._bytes], dtype=torch.long)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "file": BPE_FILE}


Tokenizer = ByteTokenizer | BPETokenizer


def tokenizer_from_dict(meta: dict, run_dir: str | Path) -> Tokenizer:
    """The tokenizer a run directory's config.json describes (`{"kind": "byte"}` or `{"kind": "bpe", ...}`)."""
    kind = meta.get("kind")
    if kind == "byte":
        return ByteTokenizer()
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
