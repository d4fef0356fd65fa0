"""Training text from a `--data` spec: the built-in corpus, `python-env`, local files or Hugging Face datasets, split
into train and validation (docs/training.md, "Training data"); training reads it through the shards `tokenize` writes.
"""

from __future__ import annotations

import inspect
import math
import os
import sysconfig
from pathlib import Path

from hybrid_attention.data.documents import VAL_FRACTION, Corpus, in_validation, name_hash

BUILTIN_MAX_BYTES = 4_000_000  # plenty for the tiny preset; reading it takes well under a second
TEXT_SUFFIXES = (".txt", ".md", ".py")
VAL_SPLITS = ("validation", "valid", "test")  # a dataset's split read as validation, the first found
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def load_corpus(spec: str | None, *, max_bytes: int | None = None, val_fraction: float = VAL_FRACTION) -> Corpus:
    """Read the text named by `spec` (docs/training.md, "Training data") and split it into train and validation.

    `max_bytes` caps how much is read: whole files up to `(1 - val_fraction) * max_bytes` for train and the rest
    for validation (a single file is cut at `max_bytes`; `hf:` rows are read in order until the share is reached).
    `None` means `BUILTIN_MAX_BYTES` for the built-in corpus and `hf:` datasets, `corpus.ENV_MAX_BYTES` for
    `python-env`, everything for a local path.
    Raises ValueError for a missing, empty or undecodable source.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"the data byte cap must be a positive number of bytes, got {max_bytes}")
    if spec is None or spec == "builtin":
        return _builtin_corpus(max_bytes or BUILTIN_MAX_BYTES, val_fraction)
    if spec == "python-env":
        from hybrid_attention.data.python_env import ENV_MAX_BYTES, env_corpus

        return env_corpus(max_bytes or ENV_MAX_BYTES, val_fraction)
    if spec.startswith("hf:"):
        return _hf_corpus(spec, max_bytes or BUILTIN_MAX_BYTES, val_fraction)
    return _path_corpus(Path(spec), max_bytes, val_fraction)


def _builtin_corpus(max_bytes: int, val_fraction: float) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"the built-in corpus needs the standard library sources, but {root} is not a directory")
    names = walk_files(root, (".py",))
    # Hash order spreads a capped read over the whole library instead of its alphabetically first modules.
    names.sort(key=lambda rel: (name_hash(rel), rel))
    docs = _read_named(root, names, max_bytes, val_fraction, strict=False)
    return _finish(docs, val_fraction, f"Python {sysconfig.get_python_version()} standard library ({root})")


def _path_corpus(path: Path, max_bytes: int | None, val_fraction: float) -> Corpus:
    if not path.exists():
        raise ValueError(f"--data {path}: no such file or directory")
    if not (path.is_file() or path.is_dir()):
        raise ValueError(f"--data {path}: neither a regular file nor a directory (a device, pipe or socket)")
    if path.is_file():
        docs = [(path.name, _read_text(path, strict=True))]
        if max_bytes is not None:
            docs = [(path.name, _cap_text(docs[0][1], max_bytes))]
        return _finish(docs, val_fraction, str(path))
    names = walk_files(path, TEXT_SUFFIXES)
    if not names:
        raise ValueError(f"--data {path}: the directory holds no {'/'.join(TEXT_SUFFIXES)} files")
    skipped: list[str] = []
    docs = _read_named(path, names, max_bytes, val_fraction, strict=False, skipped=skipped)
    note = f", {len(skipped)} that are not UTF-8 skipped (e.g. {skipped[0]})" if skipped else ""
    return _finish(docs, val_fraction, f"{path} ({len(names)} files{note})")


def walk_files(root: Path, suffixes: tuple[str, ...]) -> list[str]:
    """Relative POSIX paths of files under `root` ending in `suffixes`, sorted, skipping installed packages."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(suffixes):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def _read_text(path: Path, *, strict: bool, skipped: list[str] | None = None) -> str | None:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not strict:  # the standard library keeps a few deliberately non-UTF-8 test files, user folders a stray one
            if skipped is not None:
                skipped.append(path.name)
            return None
        raise ValueError(f"--data: {path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None


def _cap_text(text: str, max_bytes: int) -> str:
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def _read_named(
    root: Path, names: list[str], max_bytes: int | None, val_fraction: float, *, strict: bool, skipped=None
) -> list[tuple[str, str]]:
    """Read files in the given order, each split filled up to its share of `max_bytes` with whole files.

    Files that would overflow a split's share are skipped (a smaller one may still fit); a split that no file fits
    gets its smallest file, so neither is empty just because of the cap.
    """
    budget = {False: math.inf, True: math.inf}
    if max_bytes is not None:
        budget = {False: (1.0 - val_fraction) * max_bytes, True: val_fraction * max_bytes}
    used = {False: 0, True: 0}
    smallest: dict[bool, tuple[int, str]] = {}
    docs = []
    for rel in names:
        split = in_validation(rel, val_fraction)
        size = (root / rel).stat().st_size
        if used[split] + size > budget[split]:
            smallest[split] = min(smallest.get(split, (size, rel)), (size, rel))
            continue
        text = _read_text(root / rel, strict=strict, skipped=skipped)
        if text:
            docs.append((rel, text))
            used[split] += size
    for split, (_, rel) in smallest.items():
        if used[split] == 0 and (text := _read_text(root / rel, strict=strict, skipped=skipped)):
            docs.append((rel, text))
    return docs


def _finish(docs: list[tuple[str, str]], val_fraction: float, source: str) -> Corpus:
    """Split named documents by name hash, or by text when that leaves a split empty."""
    docs = [(name, text) for name, text in docs if text.strip()]
    if not docs:
        raise ValueError(f"the data source {source} holds no text")
    train = [(name, text) for name, text in docs if not in_validation(name, val_fraction)]
    val = [(name, text) for name, text in docs if in_validation(name, val_fraction)]
    if not train or not val:
        head, tail = _split_text("\n".join(text for _, text in docs), val_fraction)
        if not head or not tail:
            raise ValueError(f"the data source {source} is too small to split into train and validation")
        return Corpus(train=head, val=tail, source=f"{source}, split by text")
    return Corpus(
        train=[t for _, t in train],
        val=[t for _, t in val],
        source=source,
        train_names=[n for n, _ in train],
        val_names=[n for n, _ in val],
    )


def _split_text(text: str, val_fraction: float) -> tuple[list[str], list[str]]:
    """The last `val_fraction` of the text is validation, cut at a line boundary when there is one nearby."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    if newline > cut // 2:
        cut = newline + 1
    head, tail = text[:cut], text[cut:]
    return ([head] if head.strip() else []), ([tail] if tail.strip() else [])


def load_dataset(source: str):
    """A DatasetDict (or Dataset) from a save_to_disk folder or `hf:NAME[:CONFIG]`, never running loading scripts."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"--data {source} needs the optional `datasets` package: pip install 'hybrid-attention[data]'"
        ) from None
    try:
        if not source.startswith("hf:"):
            return datasets.load_from_disk(source)
        parts = source[len("hf:") :].split(":")
        if not parts[0] or len(parts) > 2:
            raise ValueError(f"--data {source}: expected hf:NAME or hf:NAME:CONFIG")
        # Before datasets 4.0 a loading script runs unless refused; from 4.0 on there are none and no flag.
        params = inspect.signature(datasets.load_dataset).parameters
        return datasets.load_dataset(*parts, **({"trust_remote_code": False} if "trust_remote_code" in params else {}))
    except ValueError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError, its own errors)
        raise ValueError(f"--data {source}: datasets could not load it: {type(e).__name__}: {e}") from None


def _hf_corpus(spec: str, max_bytes: int, val_fraction: float) -> Corpus:
    loaded = load_dataset(spec)
    splits = list(loaded.keys())
    if "train" not in splits:
        raise ValueError(f"--data {spec}: the dataset has no 'train' split (it has {splits})")
    val_name = next((s for s in VAL_SPLITS if s in splits), None)
    train = _hf_texts(spec, loaded["train"], (1.0 - val_fraction) * max_bytes if val_name else max_bytes)
    if val_name is None:
        docs = [(f"row-{i}", text) for i, text in enumerate(train)]
        return _finish(docs, val_fraction, spec)
    val = _hf_texts(spec, loaded[val_name], val_fraction * max_bytes)
    if not train or not val:
        raise ValueError(f"--data {spec}: the train or {val_name} split holds no text")
    return Corpus(train=train, val=val, source=f"{spec} (train, {val_name})")


def _hf_texts(spec: str, rows, max_bytes: float) -> list[str]:
    """Rows of the text column, in order, until `max_bytes` of UTF-8 is read."""
    names = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    column = "text" if "text" in names else None
    if column is None and len(rows):
        strings = [n for n in names if isinstance(rows[0][n], str)]
        column = strings[0] if len(strings) == 1 else None
    if column is None:
        raise ValueError(f"--data {spec}: no 'text' column and not exactly one string column (columns: {names})")
    texts, used = [], 0
    for row in rows:
        text = row[column]
        if text and text.strip():
            texts.append(text)
            used += len(text.encode("utf-8"))
            if used >= max_bytes:
                break
    return texts
