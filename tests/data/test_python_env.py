"""The python-env corpus builder (hybrid_attention/data/python_env.py), on folders standing in for the environment."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from hybrid_attention.data import python_env as env
from hybrid_attention.data.documents import VAL_FRACTION
from hybrid_attention.data.sources import load_corpus


def _source(i: int) -> str:
    return f"def f{i}(x):\n    return x + {i}  # {'#' * (i % 37)}\n"


def _split_of(text: str) -> bool:
    """Whether `text` is validation: the hex sha256 of its bytes, hashed again (sha256) to [0, 1)."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    return int.from_bytes(hashlib.sha256(digest.encode()).digest()[:8], "big") / 2.0**64 < VAL_FRACTION


@pytest.fixture
def roots(tmp_path):
    """Two folders of distinct sources (400 files) plus copies, caches, hidden folders and files to skip."""
    a, b = tmp_path / "stdlib", tmp_path / "site-packages"
    for i in range(400):
        root = a if i % 2 else b
        path = root / f"pkg{i % 7}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_source(i), encoding="utf-8")
    (b / "vendored").mkdir()
    for i in range(0, 40, 3):  # exact copies of files of the other root
        (b / "vendored" / f"copy{i}.py").write_text(_source(i), encoding="utf-8")
    (a / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (a / "dangling.py").symlink_to(tmp_path / "missing.py")
    (a / "empty.py").write_text("", encoding="utf-8")
    (a / "notes.txt").write_text("not python\n", encoding="utf-8")
    for skipped in ("__pycache__", ".hidden"):
        (a / skipped).mkdir()
        (a / skipped / "skip.py").write_text("SKIPPED = 1\n", encoding="utf-8")
    return [a, b]


def test_deduplicates_by_content_and_splits_by_content_hash(roots):
    c = env.env_corpus(10**9, roots=roots, progress=False)
    texts = c.train + c.val
    assert sorted(texts) == sorted(_source(i) for i in range(400))  # copies read once; skipped files absent
    assert all(not _split_of(t) for t in c.train) and all(_split_of(t) for t in c.val)
    assert c.val and len(c.val) < len(c.train)
    assert "14 duplicates" in c.source and "2 unreadable" in c.source  # the latin-1 file and the dangling link
    for name, text in zip(c.train_names + c.val_names, texts, strict=True):
        assert Path(name).read_text(encoding="utf-8") == text


def test_split_depends_on_content_only(roots, tmp_path):
    """The same file under another root, another name, another cap or next to other files keeps its split."""
    full = env.env_corpus(10**9, roots=roots, progress=False)
    moved = tmp_path / "elsewhere"
    for i, text in enumerate(full.val[:5] + full.train[:20]):
        (moved / f"x{i}").mkdir(parents=True)
        (moved / f"x{i}" / f"renamed{i}.py").write_text(text, encoding="utf-8")
    other = env.env_corpus(10**9, roots=[moved], progress=False)
    assert set(other.val) == set(full.val[:5]) and set(other.train) == set(full.train[:20])
    capped = env.env_corpus(3_000, roots=roots, progress=False)
    assert set(capped.val) <= set(full.val) and set(capped.train) <= set(full.train)
    assert env.env_corpus(3_000, roots=roots[::-1], progress=False).train == capped.train  # root order is irrelevant


def test_cap_fills_each_split_up_to_its_share_with_whole_files(roots):
    for cap in (2_000, 6_000, 20_000):
        c = env.env_corpus(cap, roots=roots, progress=False)
        n_train, n_val = c.num_bytes
        assert 0 < n_train <= (1 - VAL_FRACTION) * cap and 0 < n_val <= VAL_FRACTION * cap
        assert n_train > (1 - VAL_FRACTION) * cap - 100  # files are about 50 bytes: the share is filled
        assert set(c.train) <= {_source(i) for i in range(400)}


def test_too_little_text_and_oversized_files(tmp_path, monkeypatch):
    (tmp_path / "one.py").write_text("x = 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="too little text"):
        env.env_corpus(10**6, roots=[tmp_path], progress=False)
    monkeypatch.setattr(env, "MAX_FILE_BYTES", 5)
    with pytest.raises(ValueError, match="1 unreadable, non-UTF-8 or oversized"):
        env.env_corpus(10**6, roots=[tmp_path], progress=False)


def test_environment_roots_and_load_corpus(tmp_path, monkeypatch):
    roots = env.environment_roots()
    assert roots and all(r.is_dir() and r.is_absolute() for r in roots) and len(set(roots)) == len(roots)
    assert Path.cwd().resolve() not in roots
    monkeypatch.setattr(env, "environment_roots", lambda: [tmp_path])
    for i in range(200):
        (tmp_path / f"m{i}.py").write_text(_source(i), encoding="utf-8")
    c = load_corpus("python-env", max_bytes=4_000)
    assert c.source.startswith("Python sources of this environment") and sum(c.num_bytes) <= 4_000
    assert os.path.dirname(c.train_names[0]) == str(tmp_path)
