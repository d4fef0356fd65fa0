"""Decoding on a CUDA GPU: CUDA-graph decoding equals eager decoding token for token, batched generation of prompts of
different lengths equals one-at-a-time generation, decoding equals the full forward, chunked prefill is exact, and
the fused decode kernels (AttnRes + RMSNorm, KDA inputs / recurrent step / output norm, MLA append) match the eager
PyTorch ops at k3-scaled sizes. Run: `python -m pytest -q tests/gpu/inference/test_generate_gpu.py`.

Numbers of whole-model paths are measured against the same model run in float64 on the GPU (float64 is not a kernel
dtype, so every op runs its PyTorch reference there; `use_reference()` makes sure of it): a path
passes when it is as accurate as the plain full forward at its own precision (within a factor of 2), because two
roundings of a deep random model differ by about its conditioning times the precision, and that is what a fixed
tolerance could not know (see make_model).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.generate import generate
from hybrid_attention.inference.prefill import prefill
from hybrid_attention.layers.mla import MLACache
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.backends import use_reference
from tests.helpers import assert_as_accurate, assert_close, needs_cuda

pytestmark = needs_cuda
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
K3_BLOCK = ("kda", "kda", "kda", "mla")  # one 3:1 block at k3-scaled widths: bf16 checks of a model that is not chaotic


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 checks are against float32 math: no TF32 matmuls while these tests run."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def make_model(preset="k3-scaled", dtype=torch.bfloat16, seed=0, **overrides) -> HybridLM:
    """A random model whose AttnRes queries and norm weights are not at their init (so every path matters).

    The query entries have std 2 / sqrt(D): mixing logits of order 2, far from uniform. (With std 0.5 at D = 2048
    they would be of order 20, every AttnRes a near-argmax with cliffs, and the float32 full forward itself about 1%
    off float64 at 13 layers.)"""
    torch.manual_seed(seed)
    model = HybridLM(HybridConfig.from_preset(preset, **overrides)).to("cuda", dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0.0, 2.0 / p.numel() ** 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def float64_copy(model: HybridLM) -> HybridLM:
    """The same weights in float64 on the same GPU: the reference of every numeric check. Run it inside
    `use_reference()` (float64 CUDA tensors take the PyTorch paths anyway; the block states it). The CPU would do the
    same arithmetic several times slower at k3-scaled sizes."""
    return copy.deepcopy(model).to(torch.float64)


def prompt(B, T, vocab, seed=1):
    return torch.randint(0, vocab, (B, T), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


@pytest.mark.parametrize("preset", ["k3-scaled", "k3-scaled-all-mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 3])
def test_graph_decoding_equals_eager_decoding(preset, dtype, B):
    model = make_model(preset, dtype)
    ids = prompt(B, 37, model.config.vocab_size)
    graph = generate(model, ids, 24, temperature=0, cuda_graph=True)
    eager = generate(model, ids, 24, temperature=0, cuda_graph=False)
    assert torch.equal(graph, eager), f"{preset} {dtype} B={B}: graph tokens differ from eager tokens"

    # Step by step on two identical caches: the replayed logits equal the eager ones.
    caches = [model.make_cache(B, 64) for _ in range(2)]
    steps = [DecodeStep(model, caches[0], cuda_graph=True), DecodeStep(model, caches[1], cuda_graph=False)]
    for cache in caches:
        prefill(model, ids, cache)
    for t in range(5):
        token = graph[:, 37 + t]
        g, e = steps[0](token).clone(), steps[1](token).clone()
        assert_close(f"step {t} logits", g, e, TOL[dtype])
    assert caches[0].host_lengths == caches[1].host_lengths == [42] * B
    assert caches[0].lengths.tolist() == [42] * B
    assert all(layer.seqlens is caches[0].seqlens for layer in caches[0].layers if isinstance(layer, MLACache))


@pytest.mark.parametrize(
    "preset, overrides", [("k3-scaled", {}), ("k3-scaled-all-mla", {"mla_rope": True})], ids=["hybrid", "mla-rope"]
)
def test_graph_decoding_equals_full_recompute_float32(preset, overrides):
    """The fused row append and the Triton decode kernel under a CUDA graph, with RoPE on the shared key part too."""
    model = make_model(preset, torch.float32, seed=2, **overrides)
    ids = prompt(2, 29, model.config.vocab_size, seed=3)
    out = generate(model, ids, 16, temperature=0, cuda_graph=True)
    seq = ids
    with torch.no_grad():
        for _ in range(16):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    # And the logits themselves, for the decoded positions.
    cache = model.make_cache(2, 45)
    step = DecodeStep(model, cache, cuda_graph=True)
    prefill(model, seq[:, :29], cache)
    logits = torch.stack([step(seq[:, t]).clone() for t in range(29, 44)], dim=1)
    with torch.no_grad():
        full = model(seq[:, :44]).logits[:, 29:]
        with use_reference():
            ref64 = float64_copy(model)(seq[:, :44]).logits[:, 29:]
    assert_as_accurate(f"graph decode (float32, {preset} {overrides})", logits, ref64, full)


@pytest.mark.parametrize("preset", ["k3-scaled", "k3-scaled-all-mla"])
def test_batched_prompts_equal_one_at_a_time(preset):
    model = make_model(preset, torch.float32, seed=4)
    g = torch.Generator("cuda").manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), device="cuda", generator=g) for n in (5, 33, 1, 70)]
    batched = generate(model, prompts, 16, temperature=0)
    for b, p in enumerate(prompts):
        alone = generate(model, p[None], 16, temperature=0)[0]
        assert torch.equal(batched[b], alone), f"{preset}: prompt {b} (length {p.numel()}) differs when batched"
    # Left padding with a mask gives the same new tokens.
    T = 70
    ids = torch.zeros(4, T, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - p.numel() :], mask[b, T - p.numel() :] = p, 1
    padded = generate(model, ids, 16, temperature=0, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert torch.equal(padded[b, T:], batched[b][p.numel() :])


def test_batched_bf16_decode_close_to_full_forward():
    """bf16 batching changes GEMM shapes (and so rounding), so tokens may differ on near-ties; the batched decode
    logits of each sequence are as accurate (against float64) as that sequence's own bf16 full forward."""
    model = make_model("k3-scaled", torch.bfloat16, seed=6, layer_types=K3_BLOCK)
    ref_model = float64_copy(model)
    g = torch.Generator("cuda").manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), device="cuda", generator=g) for n in (9, 40)]
    tokens = torch.randint(0, model.config.vocab_size, (2, 4), device="cuda", generator=g)
    batch = model.make_cache(2, 48)
    step = DecodeStep(model, batch, cuda_graph=True)
    for b, p in enumerate(prompts):
        single = model.make_cache(1, p.numel())
        prefill(model, p[None], single)
        batch.load_sequence(b, single)
    batched = torch.stack([step(tokens[:, t]).clone() for t in range(4)], dim=1)  # (2, 4, vocab)
    for b, p in enumerate(prompts):
        seq = torch.cat([p, tokens[b]])[None]
        with torch.no_grad():
            full = model(seq).logits[0, p.numel() :]  # after each of the 4 tokens
            with use_reference():
                ref64 = ref_model(seq).logits[0, p.numel() :]
        assert_as_accurate(f"sequence {b}", batched[b], ref64, full)


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_prefill_is_exact(dtype, rope):
    """3001 tokens in chunks of 512 (MLA chunks go through the Triton kernel with 4096 query rows) against one call,
    both against the float64 prefill (one call); with RoPE on the shared key part, the rotated rows and the queries
    at their positions agree across chunks."""
    layers = ("mla", "mla") if rope else (None if dtype == torch.float32 else K3_BLOCK)
    overrides = {"mla_rope": True} if rope else {}
    model = make_model("k3-scaled", dtype, seed=8, **overrides, **({} if layers is None else {"layer_types": layers}))
    ids = prompt(1, 3001, model.config.vocab_size, seed=9)
    whole, chunked = model.make_cache(1, 3001), model.make_cache(1, 3001)
    a = prefill(model, ids, whole, chunk_size=4096)
    b = prefill(model, ids, chunked, chunk_size=512)
    ref_model = float64_copy(model)
    ref_cache = ref_model.make_cache(1, 3001)
    with use_reference():
        ref = prefill(ref_model, ids, ref_cache, chunk_size=4096)
    assert_as_accurate("last logits", b, ref, a)
    for x, y, r in zip(whole.layers, chunked.layers, ref_cache.layers, strict=True):
        if isinstance(x, MLACache):
            assert_as_accurate("MLA rows", y.rows, r.rows, x.rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_decode_kernels_at_k3_sizes(dtype, monkeypatch):
    """The fused decode kernels (KDA inputs / output norm, MLA append, AttnRes + RMSNorm) against the eager ops, one
    whole-model step at a time."""
    import hybrid_attention.layers.conv as conv
    import hybrid_attention.layers.kda as kda
    import hybrid_attention.layers.mla as mla
    import hybrid_attention.layers.norm as norm
    import hybrid_attention.layers.stream as stream
    from hybrid_attention.ops.attnres.mix_norm import attn_res_norm

    model = make_model("k3-scaled", dtype, seed=10, **({} if dtype == torch.float32 else {"layer_types": K3_BLOCK}))
    ids = prompt(4, 50, model.config.vocab_size, seed=11)
    fused_cache = model.make_cache(4, 56)
    prefill(model, ids[:, :45], fused_cache)
    eager_cache = copy.deepcopy(fused_cache)
    ref_model = float64_copy(model)
    ref_cache = ref_model.make_cache(4, 56)
    with use_reference():
        prefill(ref_model, ids[:, :45], ref_cache)
    with torch.no_grad():
        fused = torch.stack([model(ids[:, t : t + 1], cache=fused_cache).logits[:, 0] for t in range(45, 50)], 1)
        monkeypatch.setattr(kda, "_fused_decode_ok", lambda x, conv_size: False)
        monkeypatch.setattr(mla, "_fused_append_ok", lambda x: False)
        monkeypatch.setattr(stream, "attn_res_norm", lambda *a, **k: attn_res_norm(*a, **{**k, "backend": "torch"}))
        for module in (conv, norm):  # the eager layer's own conv and output norm, not their Triton kernels
            monkeypatch.setattr(module, "use_triton", lambda *a, **k: False)
        eager = torch.stack([model(ids[:, t : t + 1], cache=eager_cache).logits[:, 0] for t in range(45, 50)], 1)
        with use_reference():
            ref = torch.stack([ref_model(ids[:, t : t + 1], cache=ref_cache).logits[:, 0] for t in range(45, 50)], 1)
    assert_as_accurate("fused decode logits", fused, ref, eager)
    for f, e, r in zip(fused_cache.layers, eager_cache.layers, ref_cache.layers, strict=True):
        if isinstance(f, MLACache):
            assert_as_accurate("MLA rows", f.rows[:, :50], r.rows[:, :50], e.rows[:, :50])
        else:
            assert_as_accurate("KDA state", f.state, r.state, e.state)
            conv = lambda c: torch.cat([c.conv_q, c.conv_k, c.conv_v], 1)
            assert_as_accurate("KDA conv cache", conv(f), conv(r), conv(e))
    assert fused_cache.lengths.tolist() == eager_cache.lengths.tolist() == [50] * 4


def test_decode_step_capacity_and_counters():
    model = make_model("tiny", torch.bfloat16)
    cache = model.make_cache(2, 6)
    step = DecodeStep(model, cache, cuda_graph=True)
    assert cache.seq_len == 0 and cache.lengths.tolist() == [0, 0], "capture must leave the cache empty"
    prefill(model, prompt(2, 3, 256), cache)
    for _ in range(3):
        step(torch.zeros(2, dtype=torch.long, device="cuda"))
    assert cache.seq_len == 6 and cache.lengths.tolist() == [6, 6]
    with pytest.raises(ValueError, match="cache is full"):
        step(torch.zeros(2, dtype=torch.long, device="cuda"))


def test_use_reference_launches_no_kernel(monkeypatch):
    """Inside `backends.use_reference()` a CUDA forward, an eager decode step and a generation launch no Triton
    kernel, and the forward equals the float64 model to float32 accuracy."""
    from triton.runtime.jit import JITFunction

    model = make_model("tiny", torch.float32, seed=12)
    ids = prompt(2, 9, model.config.vocab_size, seed=13)

    def launch(self, *args, **kwargs):
        raise AssertionError(f"a Triton kernel was launched inside use_reference(): {getattr(self, '__name__', self)}")

    monkeypatch.setattr(JITFunction, "run", launch)
    with use_reference(), torch.no_grad():
        logits = model(ids).logits
        DecodeStep(model, model.make_cache(2, 4), cuda_graph=False)(ids[:, 0])
        generate(model, ids, 3, temperature=0, cuda_graph=False)
        ref = float64_copy(model)(ids).logits
    assert_close("reference path vs float64", logits.double(), ref, 1e-4)
