"""One dispatch rule (`ops.backends`): "auto" means the same thing for every op, every layer's fast path
follows it, and `use_reference()` sends all of them to the PyTorch references.

On a CPU the rule already picks the references, so these tests lift its CUDA check (the rule then sends CPU tensors
to the kernels) and make every Triton launch raise: without the switch each fast path reaches a kernel, with it a
whole model forward, decode step and generation launch none and equal the default CPU path exactly."""

from __future__ import annotations

import pytest
import torch

import hybrid_attention.ops.backends as backends
from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.generate import generate
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.backends import resolve, use_reference, use_triton

triton = pytest.importorskip("triton")


class KernelLaunched(Exception):
    pass


@pytest.fixture
def kernels_raise(monkeypatch):
    """Every Triton kernel launch (compiled or interpreted, autotuned or not) raises KernelLaunched."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def launch(self, *args, **kwargs):
        raise KernelLaunched(getattr(self, "__name__", "a Triton kernel"))

    monkeypatch.setattr(JITFunction, "run", launch)
    monkeypatch.setattr(InterpretedFunction, "run", launch)


@pytest.fixture
def cpu_counts_as_cuda(monkeypatch):
    """The rule without its CUDA check: CPU tensors of a kernel dtype go to the kernels."""
    monkeypatch.setattr(backends, "triton_runs_on", lambda x, cpu_interpreter=True: x.is_floating_point())


# Smaller than the tiny preset, one mixer of each kind.
SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, layer_types=("kda", "mla"), kda_head_dim=16,
    mla_kv_lora_rank=16, mla_qk_nope_head_dim=8, mla_qk_shared_head_dim=8, mla_v_head_dim=16,
)  # fmt: skip


def small_model() -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", **SMALL)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):  # non-trivial AttnRes mixing
                p.normal_()
    return model


def test_the_switch_restores_the_previous_setting():
    assert backends.fast_paths_enabled()
    with pytest.raises(RuntimeError, match="boom"), use_reference():
        assert not backends.fast_paths_enabled()
        with use_reference(False):
            assert backends.fast_paths_enabled()
        assert not backends.fast_paths_enabled()
        raise RuntimeError("boom")
    assert backends.fast_paths_enabled()
    backends.set_fast_paths(False)
    try:
        assert not backends.fast_paths_enabled()
    finally:
        backends.set_fast_paths(True)
    with pytest.raises(ValueError, match="expected True or False"):
        backends.set_fast_paths("off")


def test_auto_means_one_thing(cpu_counts_as_cuda):
    from hybrid_attention.ops.kda import resolve_backend

    x = torch.zeros(2, 3)
    assert use_triton(x) and resolve("auto", x, name="op") == "triton"
    assert not use_triton(x, needs_backward=True) and resolve("auto", x, name="op", needs_backward=True) == "torch"
    assert resolve_backend("auto", torch.zeros(1, 4, 2, 8)) == "triton"
    with use_reference():
        assert not use_triton(x) and resolve("auto", x, name="op") == "torch"
        assert resolve_backend("auto", torch.zeros(1, 4, 2, 8)) == "torch"
        assert resolve("triton", x, name="op") == "triton", "an explicit backend is honoured"
    with pytest.raises(ValueError, match="my_op: backend must be one of"):
        resolve("cuda", x, name="my_op")


def test_auto_never_picks_the_interpreter():
    """Without the lifted check: CPU tensors take the references, whatever TRITON_INTERPRET says."""
    from hybrid_attention.ops.kda import resolve_backend

    x = torch.zeros(1, 4, 2, 8)
    assert not use_triton(x) and resolve_backend("auto", x) == "torch"


@pytest.mark.parametrize("what", ["prefill", "training", "decode", "decode step"])
def test_every_fast_path_reaches_a_kernel_unless_switched_off(what, kernels_raise, cpu_counts_as_cuda):
    """A model call of each kind launches a kernel by the rule, and none inside `use_reference()`."""
    model = small_model()
    ids = torch.randint(0, 64, (2, 5))

    def call():
        if what == "training":
            return model(ids, labels=ids).loss
        with torch.no_grad():
            if what == "prefill":
                return model(ids).logits
            cache = model.make_cache(2, 8)
            if what == "decode step":
                return DecodeStep(model, cache, cuda_graph=False)(ids[:, 0])
            return model(ids[:, :1], cache=cache).logits

    with pytest.raises(KernelLaunched):
        call()
    with use_reference():
        call()


def test_each_layer_fast_path_follows_the_rule(kernels_raise, cpu_counts_as_cuda):
    """The short conv, the gated norm, the KDA fused decode, the MLA fused append, mla_decode and attn_res_norm,
    the decode GEMV and activation: each launches by the rule and runs its reference inside `use_reference()`."""
    from hybrid_attention.layers import GatedMLA, KimiDeltaAttention
    from hybrid_attention.layers.conv import ShortConv
    from hybrid_attention.layers.norm import GatedRMSNorm
    from hybrid_attention.layers.packed import _act_mul_ok, decode_gemv_enabled
    from hybrid_attention.ops.attnres.mix_norm import attn_res_norm
    from hybrid_attention.ops.mla import mla_decode

    torch.manual_seed(1)
    x = torch.randn(2, 3, 8)
    kda = KimiDeltaAttention(16, 2, head_dim=8)
    mla = GatedMLA(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_shared_head_dim=4, v_head_dim=8)
    lens = torch.full((2,), 3, dtype=torch.int32)

    def one_token(cache):
        cache.seqlens.advance(1)  # the caller counts the token it feeds
        return cache

    calls = {
        "short conv": lambda: ShortConv(8)(x),
        "gated norm": lambda: GatedRMSNorm(8)(x, x),
        "KDA fused decode": lambda: kda(torch.randn(2, 1, 16), cache=kda.empty_cache(2)),
        "MLA fused append": lambda: mla(torch.randn(2, 1, 16), cache=one_token(mla.empty_cache(2, 4))),
        "mla_decode": lambda: mla_decode(torch.randn(2, 1, 2, 12), torch.randn(2, 3, 12), lens, value_dim=8, scale=1.0),
        "attn_res_norm": lambda: attn_res_norm(torch.randn(3, 2, 8), torch.randn(8), torch.ones(8)),
    }
    with torch.no_grad():
        for name, call in calls.items():
            try:
                call()
            except KernelLaunched:
                pass
            else:
                pytest.fail(f"{name}: the rule sent CPU tensors to the kernel, but none was launched")
            with use_reference():
                call()
        assert decode_gemv_enabled(x) and _act_mul_ok(x, x)
        with use_reference():
            assert not decode_gemv_enabled(x) and not _act_mul_ok(x, x)


def test_reference_model_equals_the_default_path(kernels_raise, cpu_counts_as_cuda, monkeypatch):
    """Under the switch (and the rule otherwise sending everything to the kernels) a forward, a backward, a decode
    step and a generation launch no kernel and give exactly what the default CPU path gives."""
    model = small_model()
    ids = torch.randint(0, 64, (2, 7))

    def run():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        with torch.no_grad():
            logits = model(ids).logits
            step = DecodeStep(model, model.make_cache(2, 4), cuda_graph=False)
            stepped = torch.stack([step(ids[:, t]).clone() for t in range(3)], 1)
        tokens = generate(model, ids[:, :4], 5, temperature=0)
        return loss.detach(), grads, logits, stepped, tokens

    with use_reference():
        reference = run()
    monkeypatch.undo()  # the default rule and real kernels: on a CPU, the references again
    default = run()
    for name, a, b in zip(("loss", "gradients", "logits", "decode steps", "tokens"), reference, default, strict=True):
        assert torch.equal(a, b), name
