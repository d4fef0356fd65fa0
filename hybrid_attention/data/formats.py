"""The formats `tokenize` reads, cut into units of work: folders of text, JSON lines, JSON, Parquet, `datasets`
(docs/training.md, "Shards").
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from hybrid_attention.data.documents import in_validation
from hybrid_attention.data.sources import TEXT_SUFFIXES, VAL_SPLITS, load_dataset, walk_files

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
_loaded_dataset = functools.lru_cache(maxsize=2)(load_dataset)  # a worker reads many units of one dataset


def dataset_folder(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def plan_units(spec: str, unit_bytes: int) -> tuple[list[dict], str]:
    """(the units of `spec` in order, a description of the source). ValueError when there is nothing to read."""
    if spec.startswith("hf:"):
        return _dataset_units(spec, unit_bytes)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"--data {spec}: no such file or directory")
    if path.is_dir() and dataset_folder(path):
        return _dataset_units(str(path), unit_bytes)
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    root, names = (path, walk_files(path, suffixes)) if path.is_dir() else (path.parent, [path.name])
    if not names:
        raise ValueError(f"--data {spec}: holds no {'/'.join(suffixes)} files")
    units: list[dict] = []
    texts: list[str] = []
    text_size = 0

    def flush_texts():
        nonlocal texts, text_size
        if texts:
            units.append({"kind": "text", "root": str(root), "names": texts, "size": text_size})
            texts, text_size = [], 0

    for name in names:
        file = root / name
        size = file.stat().st_size
        if name.endswith(TEXT_SUFFIXES):
            texts.append(name)
            text_size += size
            if text_size >= unit_bytes:
                flush_texts()
            continue
        flush_texts()
        if name.endswith(".jsonl"):
            pieces = max(1, math.ceil(size / unit_bytes))
            for i in range(pieces):
                start, end = i * size // pieces, (i + 1) * size // pieces
                units.append(
                    {"kind": "jsonl", "root": str(root), "name": name, "start": start, "end": end, "size": end - start}
                )
        elif name.endswith(".json"):
            units.append({"kind": "json", "root": str(root), "name": name, "size": size})
        else:
            units += _parquet_units(root, name, unit_bytes)
    flush_texts()
    return units, f"{path} ({len(names):,} files)"


def _parquet_units(root: Path, name: str, unit_bytes: int) -> list[dict]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(root / name).metadata
    units, groups, size, row = [], [], 0, 0
    first_row = 0
    for g in range(meta.num_row_groups):
        groups.append(g)
        size += meta.row_group(g).total_byte_size
        row += meta.row_group(g).num_rows
        if size >= unit_bytes or g == meta.num_row_groups - 1:
            units.append(
                {
                    "kind": "parquet",
                    "root": str(root),
                    "name": name,
                    "groups": groups,
                    "first_row": first_row,
                    "size": size,
                }
            )
            groups, size, first_row = [], 0, row
    return units


def _dataset_units(source: str, unit_bytes: int) -> tuple[list[dict], str]:
    loaded = _loaded_dataset(source)
    splits = dict(loaded) if hasattr(loaded, "keys") else {"train": loaded}
    if "train" not in splits:
        raise ValueError(f"--data {source}: the dataset has no 'train' split (it has {sorted(splits)})")
    val_name = next((s for s in VAL_SPLITS if s in splits), None)
    units = []
    for name in ["train"] + ([val_name] if val_name else []):
        rows = len(splits[name])
        size = max(1, splits[name].data.nbytes)
        step = max(1, math.ceil(rows * unit_bytes / size))
        for start in range(0, rows, step):
            end = min(rows, start + step)
            units.append(
                {
                    "kind": "dataset",
                    "root": source,
                    "name": name,
                    "start": start,
                    "end": end,
                    "split": None if val_name is None else ("val" if name == val_name else "train"),
                    "size": size * (end - start) // max(1, rows),
                }
            )
    split_rule = f"its {val_name} split as validation" if val_name else "split by row"
    return units, f"{source} (dataset, {split_rule})"


# ---------------------------------------------------------------------------------------------------- reading units
class Skipped(Counter):
    """Counts of what a unit skipped, by reason."""


def _text(value, where: str, strict: bool, skipped: Skipped) -> str | None:
    if isinstance(value, str):
        return value
    if strict:
        raise ValueError(f"--data: {where} has no text field of type string (got {type(value).__name__})")
    skipped["records without the text field"] += 1
    return None


def read_unit(unit: dict, text_field: str, strict: bool, skipped: Skipped) -> Iterator[tuple[str, str, str | None]]:
    """The documents of `unit` as (name, text, split): split "train" or "val" when the source says, else None (the
    name decides). Skipped files and records are counted in `skipped`; `strict` raises ValueError instead."""
    root, kind = unit["root"], unit["kind"]
    if kind == "text":
        for name in unit["names"]:
            data = Path(root, name).read_bytes()
            try:
                yield name, data.decode("utf-8"), None
            except UnicodeDecodeError as e:
                if strict:
                    raise ValueError(
                        f"--data: {Path(root, name)} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                        f"{e.start}); leave out --strict to skip such files"
                    ) from None
                skipped["files that are not UTF-8"] += 1
    elif kind == "jsonl":
        yield from _jsonl(unit, text_field, strict, skipped)
    elif kind == "json":
        path = Path(root, unit["name"])
        try:
            records = json.loads(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--data: {path} is not JSON ({e}); JSON lines files end in .jsonl") from None
        records = records if isinstance(records, list) else [records]
        for row, record in enumerate(records):
            value = record if isinstance(record, str) else (record or {}).get(text_field)
            if (text := _text(value, f"{path} record {row}", strict, skipped)) is not None:
                yield f"{unit['name']}#{row}", text, None
    elif kind == "parquet":
        import pyarrow.parquet as pq

        path = Path(root, unit["name"])
        file = pq.ParquetFile(path)
        if text_field not in file.schema_arrow.names:
            raise ValueError(f"--data: {path} has no column {text_field!r} (columns: {file.schema_arrow.names})")
        column = file.read_row_groups(unit["groups"], columns=[text_field]).column(0).to_pylist()
        for i, value in enumerate(column):
            if (text := _text(value, f"{path} row {unit['first_row'] + i}", strict, skipped)) is not None:
                yield f"{unit['name']}#{unit['first_row'] + i}", text, None
    elif kind == "dataset":
        loaded = _loaded_dataset(root)
        rows = loaded[unit["name"]] if hasattr(loaded, "keys") else loaded
        if text_field not in rows.column_names:
            raise ValueError(
                f"--data {root}: no column {text_field!r} (columns: {rows.column_names}); pass --text-field"
            )
        values = rows[unit["start"] : unit["end"]][text_field]
        for i, value in enumerate(values):
            row = unit["start"] + i
            if (text := _text(value, f"{root} {unit['name']} row {row}", strict, skipped)) is not None:
                yield f"{unit['name']}#{row}", text, unit["split"]
    else:
        raise ValueError(f"unknown unit kind {kind!r}")


def _jsonl(unit: dict, text_field: str, strict: bool, skipped: Skipped) -> Iterator[tuple[str, str, None]]:
    """The records whose line starts in [start, end) of the file: a line belongs to the unit holding its first byte."""
    path = Path(unit["root"], unit["name"])
    with open(path, "rb") as f:
        pos = unit["start"]
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # inside a line: it belongs to the unit before
                pos += len(f.readline())
        f.seek(pos)
        while pos < unit["end"]:
            line = f.readline()
            if not line:
                break
            at, pos = pos, pos + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                if strict:
                    raise ValueError(f"--data: {path} at byte {at} is not a JSON line ({e})") from None
                skipped["lines that are not JSON or not UTF-8"] += 1
                continue
            value = record if isinstance(record, str) else record.get(text_field) if isinstance(record, dict) else None
            if (text := _text(value, f"{path} at byte {at}", strict, skipped)) is not None:
                yield f"{unit['name']}@{at}", text, None


def split_of(name: str, split: str | None) -> str:
    """The split of a document: the source's, else by its name."""
    return split if split is not None else ("val" if in_validation(name) else "train")
