"""Several prompts' first chunks packed into one forward (`inference.packed_prefill`) leave every slot's KDA state,
conv tails and MLA rows, and each prompt's last logits, as its own prefill into a paged cache would (float64); the
slots not packed are untouched; the engine packs new prompts and still answers each as `generate()` alone."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.packed_prefill import PackedPrefill
from hybrid_attention.inference.paged_cache import PagedCache
from hybrid_attention.layers.kda import KDACache
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close
from tests.inference.test_engine import make_engine, reference, run_until_idle, submit

PAGE = 4
TOL = 1e-12  # float64: a few hundred roundings of 1.1e-16 (the packed and the lone forward sum in different orders)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HybridLM(HybridConfig.from_preset("tiny", vocab_size=97), kda_backend="torch").double().eval()
    for name, p in m.named_parameters():  # non-trivial AttnRes mixing
        if name.endswith(".query"):
            p.data.normal_()
    return m


def paged_cache(model, slots, lengths, generator):
    """A cache of 7 slots with random contents, the given slots pointed at shuffled pages for their lengths."""
    cache = PagedCache(
        model, num_pages=60, page_size=PAGE, num_slots=7, max_context=64, device="cpu", dtype=torch.float64
    )
    for t in cache._slot_tensors() + [layer for layer in cache.layers if isinstance(layer, torch.Tensor)]:
        t.normal_(generator=generator)
    pages = torch.randperm(60, generator=generator).add(1).tolist()
    for slot, n in zip(slots, lengths, strict=True):
        cache.set_pages(slot, [pages.pop() for _ in range(-(-n // PAGE))])
    return cache


def contents(cache, slots, lengths):
    """Per slot: every KDA tensor's row and every MLA layer's rows of its tokens (read through its page table)."""
    out = []
    for slot, n in zip(slots, lengths, strict=True):
        rows = []
        for layer in cache.layers:
            if isinstance(layer, KDACache):
                rows += [layer.state[slot], layer.conv_q[slot], layer.conv_k[slot], layer.conv_v[slot]]
            else:
                table = cache.page_table[slot].long()
                pos = torch.arange(n)
                rows.append(layer[table[pos // PAGE], pos % PAGE])
        out.append(rows)
    return out


@torch.no_grad()
@pytest.mark.parametrize("lengths", [(13, 1, 30, 2), (5, 5)])
def test_packed_first_chunks_equal_each_prefill_alone(model, lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    slots = torch.randperm(7, generator=g)[: len(lengths)].tolist()  # any slots, in any order
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    state = g.get_state()
    alone = paged_cache(model, slots, lengths, g)
    for slot in slots:
        alone.clear_slot(slot)
    expected = []
    for slot, prompt in zip(slots, prompts, strict=True):
        batch = alone.batch(slot, 1)
        batch.seqlens.set([0])
        expected.append(model(prompt[None], cache=batch, logits_to_keep=1).logits[0, -1])
    g.set_state(state)
    packed = paged_cache(model, slots, lengths, g)
    untouched = [s for s in range(7) if s not in slots]
    before = contents(packed, untouched, [0] * len(untouched))
    for slot in slots:
        packed.clear_slot(slot)
    ends = torch.tensor([0, *lengths]).cumsum(0)
    out = model(
        torch.cat(prompts)[None], cache=PackedPrefill(packed, slots), cu_seqlens=ends, logits_to_keep=ends[1:] - 1
    )
    assert_close("last logits", out.logits[0], torch.stack(expected), TOL)
    for slot, got, want in zip(slots, contents(packed, slots, lengths), contents(alone, slots, lengths), strict=True):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_close(f"slot {slot}, cache tensor {i}", a, b, TOL)
    for got, want in zip(contents(packed, untouched, [0] * len(untouched)), before, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@torch.no_grad()
def test_packed_prefill_refuses_what_it_cannot_take(model):
    g = torch.Generator().manual_seed(0)
    cache = paged_cache(model, [0, 1], [3, 4], g)
    ids = torch.randint(0, 97, (1, 7))
    with pytest.raises(ValueError, match="2 documents for 3 slots"):
        model(ids, cache=PackedPrefill(cache, [0, 1, 2]), cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        model(ids, cache=PackedPrefill(cache, [0, 1]))
    with pytest.raises(ValueError, match="distinct slots"):
        PackedPrefill(cache, [1, 1])
    with pytest.raises(ValueError, match=r"outside|in \[0, 7\)"):
        PackedPrefill(cache, [0, 9])
    with pytest.raises(ValueError, match="positions must lie in"):
        model(ids, logits_to_keep=torch.tensor([2, 7]))
    with pytest.raises(ValueError, match="1-D integer positions"):
        model(ids, logits_to_keep=torch.tensor([[1]]))


@torch.no_grad()
def test_logits_at_positions_equal_the_full_logits_there(model):
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    full = model(ids).logits
    where = torch.tensor([0, 10, 4])
    assert_close("logits at positions", model(ids, logits_to_keep=where).logits, full[:, where], TOL)


def test_the_engine_packs_new_prompts_and_answers_each_as_alone(model):
    engine = make_engine(model, max_prefilling=4, max_batched_tokens=64)
    calls, real = [], engine.prefill_packed

    def counted(chunks):
        calls.append([(c.start, c.end) for c in chunks])
        return real(chunks)

    engine.prefill_packed = counted
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (9, 1, 17, 30)]
    requests = [submit(engine, p, [], max_tokens=6, temperature=0) for p in prompts]
    run_until_idle(engine)
    assert calls and len(calls[0]) > 1 and all(start == 0 for call in calls for start, _ in call)
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.tokens == reference(model, prompt, 6)
    assert engine.stats()["pages_used"] == 0 and engine.stats()["slots_used"] == 0
