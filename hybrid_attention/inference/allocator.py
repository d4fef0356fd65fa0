"""A free list of fixed-size blocks (cache pages, state slots): allocate a few, free them, never hand one out twice.

Torch-free and host-only: the serving engine asks it which page or slot to use and writes the tensors itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybrid_attention.checks import is_int


class BlockAllocator:
    """`num_blocks` blocks, numbered `first .. first + num_blocks - 1`, each free or held.

    Freed blocks go back to the end of the free list and the next allocation takes from its front, so a block rests
    as long as possible before it is reused (a stale write to it shows up in tests instead of hiding in the reuse).
    """

    def __init__(self, num_blocks: int, *, first: int = 0, name: str = "block"):
        if not is_int(num_blocks) or num_blocks < 0 or not is_int(first) or first < 0:
            raise ValueError(f"BlockAllocator: num_blocks={num_blocks!r}, first={first!r}; expected integers >= 0")
        self.name = name
        self.first = first
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(first, first + num_blocks))
        self._head = 0  # self._free[self._head:] are free; the consumed prefix is dropped now and then
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free) - self._head

    @property
    def num_used(self) -> int:
        return len(self._held)

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks (now held), or ValueError naming how many are free; nothing changes on failure."""
        if not is_int(count) or count < 0:
            raise ValueError(f"BlockAllocator.allocate: count={count!r}; expected an integer >= 0")
        if count > self.num_free:
            raise ValueError(f"no free {self.name}s: {count} wanted, {self.num_free} of {self.num_blocks} free")
        blocks = self._free[self._head : self._head + count]
        self._head += count
        if self._head > 1024 and self._head * 2 > len(self._free):
            self._free = self._free[self._head :]
            self._head = 0
        self._held.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return held blocks; ValueError (changing nothing) for a block that is not held, or one given twice."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks) or not self._held.issuperset(blocks):
            bad = sorted(b for b in set(blocks) if b not in self._held or blocks.count(b) > 1)
            raise ValueError(f"BlockAllocator.free: {self.name}s {bad[:8]} are not held (freed twice?)")
        self._held.difference_update(blocks)
        self._free.extend(blocks)

    def is_held(self, block: int) -> bool:
        return block in self._held

    def __repr__(self) -> str:
        return f"BlockAllocator({self.name}s: {self.num_used} held, {self.num_free} free of {self.num_blocks})"
