"""The serving scheduler as a unit: thousands of random arrivals, prefill chunks, decode steps, stops and
cancellations against a model of the device (what each slot holds, where each page-table row points): no page or
slot leaks or is shared, decoding sequences stay packed in the first slots, empty slots point nowhere, the token
budget holds, and everything returns to the start once the traffic ends."""

from __future__ import annotations

import random

import pytest

from hybrid_attention.inference.scheduler import DECODING, DONE, PREFILLING, Clear, Move, QueueFull, Scheduler, Sequence

LIMITS = dict(max_running=6, max_prefilling=2, num_pages=40, page_size=4, max_queue=5, max_batched_tokens=16)


class Device:
    """What the engine keeps on the device, per slot: the sequence whose state is there, and its page-table row."""

    def __init__(self, num_slots: int):
        self.state: list[Sequence | None] = [None] * num_slots
        self.table: list[list[int]] = [[] for _ in range(num_slots)]

    def admit(self, seq: Sequence) -> None:
        self.state[seq.slot], self.table[seq.slot] = seq, list(seq.pages)

    def apply(self, changes) -> None:
        for change in changes:
            if isinstance(change, Move):
                self.state[change.dst], self.table[change.dst] = self.state[change.src], list(change.seq.pages)
            else:
                assert isinstance(change, Clear)
                self.table[change.slot] = []


def check(s: Scheduler, device: Device, live: list[Sequence]) -> None:
    running = s.prefilling + s.decoding
    pages = [p for seq in running for p in seq.pages]
    assert len(pages) == len(set(pages)) == s.pages.num_used and all(1 <= p <= 40 for p in pages)
    assert s.num_running <= LIMITS["max_running"] and len(s.waiting) <= LIMITS["max_queue"]
    for i, seq in enumerate(s.decoding):
        assert seq.slot == i and seq.state == DECODING and device.state[i] is seq and device.table[i] == seq.pages
    for seq in s.prefilling:
        assert seq.state == PREFILLING and seq.slot >= LIMITS["max_running"] and device.state[seq.slot] is seq
        assert device.table[seq.slot] == seq.pages
    for slot in range(len(s.decoding), LIMITS["max_running"]):
        assert device.table[slot] == []  # a padding row there writes to the scratch page only
    for seq in live:
        if seq.state in (PREFILLING, DECODING):
            assert len(seq.pages) == s.pages_for(seq.prompt_len + seq.max_tokens)


def test_random_traffic_never_leaks_pages_or_slots():
    rng = random.Random(0)
    s = Scheduler(**LIMITS)
    device = Device(LIMITS["max_running"] + LIMITS["max_prefilling"])
    live: list[Sequence] = []
    refused = finished = 0
    for event in range(4000):
        kind = rng.random()
        if kind < 0.3 and event < 3500:  # arrivals stop near the end so that everything drains
            seqs = [Sequence(rng.randint(1, 30), rng.randint(1, 12)) for _ in range(rng.choice([1, 1, 2]))]
            try:
                s.add(seqs)
                live += seqs
            except QueueFull:
                refused += 1
        elif kind < 0.4 and live:  # a client goes away, wherever its request is
            seq = rng.choice(live)
            device.apply(s.retire(seq))
        else:  # one iteration of the engine
            for seq in s.admit():
                device.admit(seq)
            chunks = s.prefill_plan()
            assert sum(c.end - c.start for c in chunks) <= LIMITS["max_batched_tokens"]  # decoding or not
            for chunk in chunks:
                device.apply(s.prefilled(chunk))
            rows = list(s.decoding)
            device.apply(s.decoded(rows))
            for seq in rows:  # a stop string ends some early
                if seq.state == DECODING and rng.random() < 0.05:
                    device.apply(s.retire(seq))
        finished += sum(seq.state == DONE for seq in live)
        live = [seq for seq in live if seq.state != DONE]
        check(s, device, live)
    while not s.idle():
        for seq in s.admit():
            device.admit(seq)
        for chunk in s.prefill_plan():
            device.apply(s.prefilled(chunk))
        device.apply(s.decoded(list(s.decoding)))
        check(s, device, live)
    assert s.pages.num_used == 0 and s.prefill_slots.num_used == 0 and refused > 0 and finished > 300
    assert all(row == [] for row in device.table[: LIMITS["max_running"]])


def test_admission_waits_for_memory_in_arrival_order():
    s = Scheduler(**{**LIMITS, "num_pages": 10})
    big, small = Sequence(30, 10), Sequence(1, 1)  # 10 pages, then 1
    s.add([big, small])
    assert s.admit() == [big] and list(s.waiting) == [small]  # no pages left: small waits behind big
    s.retire(big)
    assert s.admit() == [small] and s.pages.num_used == 1


def test_a_one_token_request_ends_at_its_prefill():
    s = Scheduler(**LIMITS)
    seq = Sequence(5, 1)
    s.add([seq])
    s.admit()
    (chunk,) = s.prefill_plan()
    assert chunk.last and s.prefilled(chunk) == [Clear(LIMITS["max_running"])]
    assert seq.state == DONE and s.pages.num_used == 0 and s.idle()


def test_the_prefill_budget_grows_while_nothing_decodes_and_chunks_end_on_pages():
    s = Scheduler(**{**LIMITS, "idle_prefill_tokens": 64})
    alone = Sequence(101, 5)
    s.add([alone])
    s.admit()
    spans = []
    while alone.state != DECODING:
        (chunk,) = s.prefill_plan()
        spans.append((chunk.start, chunk.end))
        s.prefilled(chunk)
    assert spans == [(0, 64), (64, 101)]  # no sequence decodes: 64 tokens an iteration, not 16
    beside = Sequence(30, 5)
    s.add([beside])
    s.admit()
    (chunk,) = s.prefill_plan()
    assert (chunk.start, chunk.end) == (0, 16)  # 16 prompt tokens beside the decoding one, ending on a page
    s.prefilled(chunk)
    (chunk,) = s.prefill_plan()
    assert (chunk.start, chunk.end) == (16, 30)


def test_bad_limits():
    with pytest.raises(ValueError, match="limit"):
        Scheduler(**{**LIMITS, "num_pages": 0})
