"""The block allocator of the serving engine's pages and slots: no block handed out twice, none lost, errors that
change nothing."""

from __future__ import annotations

import random

import pytest

from hybrid_attention.inference.allocator import BlockAllocator


def test_allocate_and_free_round_trip():
    pages = BlockAllocator(5, first=1, name="page")
    a = pages.allocate(3)
    assert sorted(a) == [1, 2, 3] and pages.num_free == 2 and pages.num_used == 3
    pages.free(a[:1])
    b = pages.allocate(3)
    assert not set(b) & set(a[1:]) and pages.num_free == 0
    with pytest.raises(ValueError, match="no free pages: 1 wanted, 0 of 5 free"):
        pages.allocate(1)
    assert pages.allocate(0) == []


def test_freeing_what_is_not_held_changes_nothing():
    slots = BlockAllocator(4, name="slot")
    held = slots.allocate(2)
    for bad in ([held[0], held[0]], [3], [held[1], 99]):
        with pytest.raises(ValueError, match="not held"):
            slots.free(bad)
        assert slots.num_used == 2 and all(slots.is_held(h) for h in held)
    with pytest.raises(ValueError, match="count"):
        slots.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1)


def test_random_traffic_never_leaks_or_doubles():
    rng = random.Random(0)
    pool = BlockAllocator(64, first=1)
    owners: list[list[int]] = []
    for _ in range(5000):
        if owners and (rng.random() < 0.5 or not pool.can_allocate(1)):
            pool.free(owners.pop(rng.randrange(len(owners))))
        else:
            want = rng.randint(1, 12)
            if pool.can_allocate(want):
                owners.append(pool.allocate(want))
            else:
                with pytest.raises(ValueError):
                    pool.allocate(want)
        held = [b for blocks in owners for b in blocks]
        assert len(held) == len(set(held)) == pool.num_used
        assert pool.num_used + pool.num_free == 64 and all(1 <= b <= 64 for b in held)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free == 64 and sorted(pool.allocate(64)) == list(range(1, 65))
