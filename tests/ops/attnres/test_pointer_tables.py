"""The AttnRes kernels' pointer tables (`ops/attnres/rows.py`): cached by contents outside a CUDA graph capture, and
carved from a pinned arena set aside before a capture (the arena logic runs here on an ordinary host tensor)."""

from collections import OrderedDict

import pytest
import torch

from hybrid_attention.ops.attnres import rows


def test_tables_hold_the_pointers_and_are_cached_by_contents(monkeypatch):
    monkeypatch.setattr(rows, "_tables", OrderedDict())  # earlier tests' tables may hold these recycled addresses
    tensors = [torch.randn(3, 5) for _ in range(4)]
    before = rows.tables_built()
    table = rows.pointer_table(tensors)
    assert table.dtype == torch.int64 and table.tolist() == [t.data_ptr() for t in tensors]
    assert rows.pointer_table(list(tensors)) is table  # the same addresses: the cached table
    other = rows.pointer_table(tensors[::-1])
    assert other is not table and other.tolist() == table.tolist()[::-1]
    assert rows.tables_built() == before + 2  # built for the two orders, found the second time


def test_capture_arena_hands_out_consecutive_slices_and_refuses_overflow():
    captured = rows.CapturedTables()
    captured.arena = torch.zeros(7, dtype=torch.int64)  # stands in for the pinned arena
    first = captured.host_slice([11, 12, 13])
    second = captured.host_slice([21, 22])
    assert first.tolist() == [11, 12, 13] and second.tolist() == [21, 22]
    assert first.data_ptr() == captured.arena.data_ptr()  # slices of the arena, not copies
    assert second.data_ptr() == captured.arena[3:].data_ptr()
    assert captured.arena.tolist() == [11, 12, 13, 21, 22, 0, 0]
    with pytest.raises(RuntimeError, match="more than the 7 pinned entries"):
        captured.host_slice([1, 2, 3])
    assert captured.used == 5  # a refused table takes nothing


def test_captured_tables_collects_only_inside_its_block():
    before = len(rows._captured)
    with rows.captured_tables(arena_entries=0) as kept:
        assert rows._captured[-1] is kept and kept.tables == []
    assert len(rows._captured) == before and kept not in rows._captured
