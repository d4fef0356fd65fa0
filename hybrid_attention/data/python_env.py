"""The `python-env` corpus: the Python sources of the running environment, deduplicated and split by content hash,
capped with whole files (docs/training.md, "Training data").
"""

from __future__ import annotations

import hashlib
import os
import site
import sys
import sysconfig
from pathlib import Path

from hybrid_attention.data.documents import VAL_FRACTION, Corpus, in_validation, name_hash

ENV_MAX_BYTES = 256_000_000  # the default cap: tokenizing it takes seconds on a GPU host's cores, and it is cached
MAX_FILE_BYTES = 1_000_000
_SKIP_DIRS = {"__pycache__", "lib-dynload"}


def environment_roots() -> list[Path]:
    """The folders the running interpreter imports Python sources from: the standard library, site-packages (system
    and user) and the rest of `sys.path` except the current directory; existing folders only, each once."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    candidates += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    candidates += [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    cwd = Path.cwd().resolve()
    candidates += [p for p in sys.path if p and Path(p).resolve() != cwd]
    roots, seen = [], set()
    for c in candidates:
        path = Path(c).resolve()
        if path.is_dir() and path not in seen:
            seen.add(path)
            roots.append(path)
    return roots


def _walk(root: Path, other_roots: set[Path]) -> list[str]:
    """Relative POSIX paths of the `*.py` files under `root`, not descending into hidden folders, caches or folders
    that are roots of their own (site-packages inside the standard library is walked once, as its own root)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".") and (here / d) not in other_roots
        ]
        found += [(here / f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")]
    return found


def _read(path: Path) -> tuple[bytes, str] | None:
    """(bytes, text) of a readable UTF-8 file of at most MAX_FILE_BYTES (empty for an empty file), else None."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = path.read_bytes()
        return data, data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def env_corpus(
    max_bytes: int = ENV_MAX_BYTES,
    val_fraction: float = VAL_FRACTION,
    *,
    roots: list[Path] | None = None,
    progress: bool = True,
) -> Corpus:
    """The Python sources under `roots` (default `environment_roots()`), at most `max_bytes` of UTF-8 in all.

    Returns a Corpus whose names are the files' paths. Raises ValueError when the roots hold no usable source, or
    too little to give both splits a file.
    """
    from tqdm import tqdm

    roots = [Path(r).resolve() for r in (environment_roots() if roots is None else roots)]
    root_set = set(roots)
    files = [(root, rel) for root in roots for rel in _walk(root, root_set - {root})]
    # Path order inside the root, so the same package is visited in the same order wherever it is installed.
    files.sort(key=lambda f: (name_hash(f[1]), f[1], str(f[0])))
    budget = {False: (1.0 - val_fraction) * max_bytes, True: val_fraction * max_bytes}
    used = {False: 0, True: 0}
    docs: dict[bool, list[tuple[str, str]]] = {False: [], True: []}
    seen: set[bytes] = set()
    duplicates = skipped = 0
    bar = tqdm(files, desc="python-env corpus", unit="file", disable=not progress, mininterval=1.0, leave=False)
    for root, rel in bar:
        read = _read(root / rel)
        if read is None:
            skipped += 1
            continue
        data, text = read
        if not text.strip():
            continue  # empty package markers are common and hold nothing to learn
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        split = in_validation(digest.hex(), val_fraction)
        if used[split] + len(data) > budget[split]:
            continue  # a smaller file may still fit
        docs[split].append(((root / rel).as_posix(), text))
        used[split] += len(data)
        if all(budget[s] - used[s] < min(4096, budget[s] / 100) for s in budget):  # both splits are full
            break
    bar.close()
    source = (
        f"Python sources of this environment ({len(roots)} folders; {len(docs[False]) + len(docs[True]):,} files, "
        f"{duplicates:,} duplicates and {skipped:,} unreadable, non-UTF-8 or oversized files skipped)"
    )
    if not docs[False] or not docs[True]:
        raise ValueError(
            f"{source}: too little text to give both the training and the validation split a file "
            f"(folders: {', '.join(map(str, roots)) or 'none'})"
        )
    return Corpus(
        train=[t for _, t in docs[False]],
        val=[t for _, t in docs[True]],
        source=source,
        train_names=[n for n, _ in docs[False]],
        val_names=[n for n, _ in docs[True]],
    )
