"""The model over the serving engine's paged cache: chunked prefill of each sequence into its pages and slot, then
batched decode steps over slots of different lengths with padding rows, equal the full forward of each sequence
(float32); moving a sequence to another slot keeps it going."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.paged_cache import PagedCache
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HybridLM(HybridConfig.from_preset("tiny"), kda_backend="torch").eval()
    for name, p in m.named_parameters():  # non-trivial AttnRes mixing
        if name.endswith(".query"):
            p.data.normal_()
    return m


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def test_paged_prefill_and_padded_decode_equal_the_full_forward(model):
    page_size = 4
    cache = PagedCache(
        model, num_pages=40, page_size=page_size, num_slots=6, max_context=40, device="cpu", dtype=torch.float32
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 13)]
    seen = []  # per sequence, the logits of its last position after every call
    free_pages = torch.randperm(40, generator=g).add(1).tolist()  # pages in shuffled order
    for slot, prompt in enumerate(prompts):
        pages = [free_pages.pop() for _ in range(cache.pages_for(len(prompt) + 6))]
        cache.set_pages(slot, pages)
        done = 0
        for size in (5, 3, 100):  # chunks of different sizes
            if done == len(prompt):
                break
            chunk = prompt[done : done + size]
            single = cache.batch(slot, 1)
            single.seqlens.set([done])
            logits = model(torch.tensor([chunk]), cache=single).logits[0, -1]
            done += len(chunk)
        seen.append([logits])
    # Decode 5 tokens for all three, as a batch of 4 slots (slot 3 a padding row at length 0).
    seqs = [list(p) for p in prompts]
    batch = cache.batch(0, 4)
    for _ in range(5):
        nxt = [int(torch.randint(0, 256, (1,), generator=g)) for _ in seqs]
        batch.seqlens.set([len(s) for s in seqs] + [0])
        logits = model(torch.tensor([[t] for t in nxt + [0]]), cache=batch).logits[:, -1]
        for b, s in enumerate(seqs):
            s.append(nxt[b])
            seen[b].append(logits[b])
    # Move the last sequence into slot 0 (its KDA rows, its page-table row) and keep decoding it there.
    cache.move_slot(2, 0)
    cache.set_pages(0, cache.page_table[2].tolist())
    single = cache.batch(0, 1)
    single.seqlens.set([len(seqs[2])])
    seqs[2].append(9)
    seen[2].append(model(torch.tensor([[9]]), cache=single).logits[0, -1])
    for b, s in enumerate(seqs):  # the full forward once per sequence: every step's logits at once
        steps = len(seen[b])
        want = full_logits(model, s)[-steps:]
        assert_close(f"sequence {b}: prefill, decode steps, the move", torch.stack(seen[b]), want, 1e-5)


def test_cache_sizes_count_pages_and_slots(model):
    cache = PagedCache(
        model, num_pages=8, page_size=16, num_slots=3, max_context=100, device="cpu", dtype=torch.float32
    )
    assert cache.max_pages == 7 and cache.pages_for(17) == 2
    page = PagedCache.page_bytes(model, 16, torch.float32)
    slot = PagedCache.slot_bytes(model, torch.float32)
    assert page == 16 * model.cache_bytes_per_token(torch.float32)
    assert cache.nbytes() == 9 * page + 3 * slot + 3 * 7 * 4  # the scratch page, the slots, the int32 table
    with pytest.raises(ValueError, match="slots"):
        cache.batch(2, 2)
