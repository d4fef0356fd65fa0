"""Packed first chunks on a CUDA GPU at k3-scaled sizes (varlen flash attention, the varlen KDA kernels): the last
logits of several prompts prefilled in one packed forward are as accurate as each prompt's own forward (both against
the same model in float32), and the prefix they leave in the paged cache continues as each prompt's own would."""

from __future__ import annotations

import copy

import torch

from hybrid_attention.inference.packed_prefill import PackedPrefill
from hybrid_attention.inference.paged_cache import PagedCache
from tests.gpu.inference.test_generate_gpu import make_model
from tests.helpers import assert_as_accurate, needs_cuda

pytestmark = needs_cuda
PAGE = 64


@torch.no_grad()
def test_packed_first_chunks_then_a_chunk_each_equal_one_forward():
    model = make_model("k3-scaled", torch.bfloat16, seed=5)
    reference = copy.deepcopy(model).float()
    g = torch.Generator().manual_seed(6)
    lengths, more = [3001, 17, 1024, 5], 700  # first chunks packed, then one more chunk per prompt, alone
    prompts = [torch.randint(0, model.config.vocab_size, (n + more,), generator=g).cuda() for n in lengths]
    slots = [4, 1, 0, 6]
    cache = PagedCache(
        model, num_pages=400, page_size=PAGE, num_slots=8, max_context=8192, device="cuda", dtype=torch.bfloat16
    )
    pages = iter(range(1, 401))
    for slot, prompt in zip(slots, prompts, strict=True):
        cache.clear_slot(slot)
        cache.set_pages(slot, [next(pages) for _ in range(-(-prompt.numel() // PAGE))])
    ends = torch.tensor([0, *lengths]).cumsum(0)
    ids = torch.cat([p[:n] for p, n in zip(prompts, lengths, strict=True)])[None]
    packed = model(ids, cache=PackedPrefill(cache, slots), cu_seqlens=ends, logits_to_keep=ends[1:].cuda() - 1)
    for i, (slot, prompt, n) in enumerate(zip(slots, prompts, lengths, strict=True)):
        alone = model(prompt[None, :n]).logits[0, -1]
        want = reference(prompt[None, :n]).logits[0, -1]
        assert_as_accurate(f"prompt {i}: packed", packed.logits[0, i].float(), want, alone.float())
        batch = cache.batch(slot, 1)
        batch.seqlens.set([n])
        then = model(prompt[None, n:], cache=batch, logits_to_keep=1).logits[0, -1]
        assert_as_accurate(
            f"prompt {i}: a chunk after the packed one",
            then.float(),
            reference(prompt[None]).logits[0, -1],
            model(prompt[None]).logits[0, -1].float(),
        )
