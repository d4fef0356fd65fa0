"""The serving engine's scheduler, host-only and torch-free: admission (the pages of prompt + max_tokens, a prefill
slot), prefill chunks under the per-iteration token budget, and the slots of decoding sequences, packed at the front
(docs/inference.md, "Serving"). Nothing is preempted: when memory is short, requests wait in a bounded queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hybrid_attention.inference.allocator import BlockAllocator

WAITING, PREFILLING, DECODING, DONE = "waiting", "prefilling", "decoding", "done"


class QueueFull(Exception):
    """The waiting queue holds `max_queue` requests already."""


class ShuttingDown(Exception):
    """The engine takes no new requests: it is shutting down."""


@dataclass(eq=False)
class Sequence:
    """One prompt's progress: its pages, its slot, the prompt tokens in the cache and the tokens sampled so far (a
    token counts once its sampling is queued on the device). `owner` is whatever the engine attaches."""

    prompt_len: int
    max_tokens: int
    owner: Any = None
    state: str = WAITING
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0
    generated: int = 0

    @property
    def cached(self) -> int:
        """Tokens in the cache before the next decode step (the newest sampled token is that step's input)."""
        return self.prefilled + max(self.generated - 1, 0)


@dataclass
class Move:
    """Sequence `seq` moves from slot `src` to slot `dst` (its KDA rows and its page-table row go with it)."""

    seq: Sequence
    src: int
    dst: int


@dataclass
class Clear:
    """Slot `slot` is left empty: its page-table row must point nowhere (a padding row may run there)."""

    slot: int


SlotChanges = list[Move | Clear]  # what the device must follow, in order


@dataclass
class PrefillChunk:
    """Prompt tokens [start, end) of `seq`, to run this iteration."""

    seq: Sequence
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == self.seq.prompt_len


class Scheduler:
    """Admission, chunk planning and slot bookkeeping (docs/inference.md, "Serving")."""

    def __init__(
        self,
        *,
        max_running: int,
        max_prefilling: int,
        num_pages: int,
        page_size: int,
        max_queue: int,
        max_batched_tokens: int,
        idle_prefill_tokens: int | None = None,
    ):
        idle_prefill_tokens = idle_prefill_tokens or max_batched_tokens
        limits = (max_running, max_prefilling, num_pages, page_size, max_batched_tokens, idle_prefill_tokens)
        if min(limits) < 1 or max_queue < 0:
            raise ValueError("Scheduler: every limit must be >= 1 (max_queue >= 0)")
        self.max_running, self.max_queue = max_running, max_queue
        self.page_size, self.max_batched_tokens = page_size, max_batched_tokens
        self.idle_prefill_tokens = idle_prefill_tokens
        self.pages = BlockAllocator(num_pages, first=1, name="page")  # page 0 is the cache's scratch page
        self.prefill_slots = BlockAllocator(max_prefilling, first=max_running, name="prefill slot")
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []  # decoding[i] sits in slot i

    # ------------------------------------------------------------------------------------------------ queries
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    # ------------------------------------------------------------------------------------------------- events
    def add(self, seqs: list[Sequence]) -> None:
        """Queue sequences (all or none: QueueFull when they do not all fit in the queue)."""
        if len(self.waiting) + len(seqs) > self.max_queue:
            raise QueueFull(f"the queue holds {len(self.waiting)} of {self.max_queue} requests")
        self.waiting.extend(seqs)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences, oldest first, into prefill slots while pages, slots and room to run allow."""
        admitted = []
        while self.waiting and self.num_running < self.max_running and self.prefill_slots.can_allocate(1):
            seq = self.waiting[0]
            need = self.pages_for(seq.prompt_len + seq.max_tokens)
            if not self.pages.can_allocate(need):
                break  # first come, first served: later requests do not overtake one that waits for memory
            self.waiting.popleft()
            seq.pages = self.pages.allocate(need)
            (seq.slot,) = self.prefill_slots.allocate(1)
            seq.state = PREFILLING
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_plan(self) -> list[PrefillChunk]:
        """This iteration's prefill chunks, given to the prefilling sequences in admission order: while sequences
        decode, `max_batched_tokens` prompt tokens (their time per token stays bounded; their own tokens go through
        the decode step, whose cost does not depend on the prefill); when none does, `idle_prefill_tokens` (a prompt
        alone prefills in a few large chunks). A chunk that does not end its prompt ends on a page boundary, so
        later chunks start on a fresh page and chunk shapes repeat."""
        budget = self.max_batched_tokens if self.decoding else self.idle_prefill_tokens
        chunks = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            end = min(seq.prompt_len, seq.prefilled + budget)
            if end < seq.prompt_len and end - end % self.page_size > seq.prefilled:
                end -= end % self.page_size
            chunks.append(PrefillChunk(seq, seq.prefilled, end))
            budget -= end - seq.prefilled
        return chunks

    def prefilled(self, chunk: PrefillChunk) -> SlotChanges:
        """The chunk ran. After the prompt's last one its first token is being sampled: the sequence moves to the
        next decode slot (or ends, when that token is all it asked for)."""
        seq = chunk.seq
        seq.prefilled = chunk.end
        if not chunk.last:
            return []
        seq.generated = 1
        if seq.generated >= seq.max_tokens:
            return self.retire(seq)
        self.prefilling.remove(seq)
        self.prefill_slots.free([seq.slot])
        move = Move(seq, seq.slot, len(self.decoding))
        seq.slot, seq.state = move.dst, DECODING
        self.decoding.append(seq)
        return [move, Clear(move.src)]

    def decoded(self, rows: list[Sequence]) -> SlotChanges:
        """A decode step over `rows` (the decoding sequences when it was queued) was queued: each has one more
        token; those that reached max_tokens end."""
        changes = []
        for seq in rows:
            if seq.state != DECODING:
                continue
            seq.generated += 1
            if seq.generated >= seq.max_tokens:
                changes += self.retire(seq)
        return changes

    def retire(self, seq: Sequence) -> SlotChanges:
        """Free the pages and slot of a running or waiting sequence at once (finished, stopped, cancelled, failed).
        A decoding sequence's slot is filled by the last decoding one. Retiring twice does nothing."""
        if seq.state == DONE:
            return []
        if seq.state == WAITING:
            self.waiting.remove(seq)
            seq.state = DONE
            return []
        self.pages.free(seq.pages)
        seq.pages = []
        changes: SlotChanges = []
        if seq.state == PREFILLING:
            self.prefilling.remove(seq)
            self.prefill_slots.free([seq.slot])
            changes.append(Clear(seq.slot))
        else:
            hole, last = seq.slot, self.decoding.pop()
            if last is not seq:
                self.decoding[hole] = last
                changes.append(Move(last, last.slot, hole))
                last.slot = hole
            changes.append(Clear(len(self.decoding)))
        seq.slot, seq.state = None, DONE
        return changes
