"""On a GPU: selective activation checkpointing in every step mode, the memory estimate against the allocator's peak,
and `--fp8` (an Ada or Hopper GPU and torchao) against bf16 (skips without CUDA).

Run on a GPU machine: python -m pytest -q tests/gpu/training/test_scale_features_gpu.py
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.training.activation_checkpointing import apply_activation_checkpointing
from hybrid_attention.training.memory import training_memory
from hybrid_attention.training.optim import build_optimizers
from hybrid_attention.training.step import TrainStep
from tests.helpers import needs_cuda, run_cli

pytestmark = needs_cuda

# The k3 layer pattern (13 layers) at a small width, heads of 128 as the pretraining presets have.
SIZES = dict(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1536,
    kda_num_heads=4,
    kda_head_dim=128,
    mla_num_heads=4,
    mla_kv_lora_rank=128,
    mla_qk_nope_head_dim=96,
    mla_qk_shared_head_dim=32,
    mla_v_head_dim=128,
)
# The estimate's tolerance against torch.cuda.max_memory_allocated: it counts what the code saves, not the
# allocator's rounding or a kernel's scratch.
MEMORY_MARGIN = 0.15


def _run(config: HybridConfig, *, checkpointing="none", fp8=None, mode="eager", steps=4, B=2, T=512, lr=2.0**-10):
    """`steps` steps of fused AdamW under bf16 autocast on fixed random batches: (losses, peak bytes of the last
    step, the model)."""
    torch.manual_seed(0)
    model = HybridLM(config).cuda()
    if fp8:
        from hybrid_attention.training.fp8 import convert_to_fp8

        convert_to_fp8(model, fp8)
    apply_activation_checkpointing(model, checkpointing)
    optimizers = build_optimizers(model, optimizer="adamw", lr=lr, weight_decay=0.1)
    runner = torch.compile(model) if mode == "compile" else model
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    step = TrainStep(
        lambda ids: runner(ids, labels=ids, return_logits=False).loss,
        model.parameters(),
        optimizers,
        grad_accum=1,
        clip=1.0,
        autocast=autocast,
        cuda_graph=mode == "graph",
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = torch.randint(0, config.vocab_size, (8, 1, B, T), device="cuda", generator=gen)
    losses = []
    for i in range(steps):
        if i == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses.append(float(step.step(batches[i % len(batches)])[0]))
    torch.cuda.synchronize()
    return losses, torch.cuda.max_memory_allocated(), model


@pytest.mark.parametrize("mode", ["eager", "graph", "compile"])
@pytest.mark.parametrize("kind", ["mixer", "all"])
def test_checkpointed_training_matches_the_plain_one_in_every_mode(mode, kind):
    config = HybridConfig.from_preset("k3-scaled-block", **SIZES)
    plain, plain_peak, _ = _run(config, mode=mode)
    recomputed, peak, _ = _run(config, checkpointing=kind, mode=mode)
    for a, b in zip(plain, recomputed, strict=True):
        # The recompute repeats the forward's bf16 kernels; SDPA's backward may accumulate with atomics.
        assert math.isfinite(b) and abs(a - b) <= 1e-2 * abs(a), (plain, recomputed)
    assert peak < plain_peak, (mode, kind, plain_peak, peak)


@pytest.mark.parametrize(
    "residual, kind", [("block_attnres", "none"), ("block_attnres", "mixer"), ("attnres", "none"), ("standard", "all")]
)
def test_the_estimate_is_near_the_allocators_peak(residual, kind):
    config = HybridConfig.from_preset("k3-scaled-block", **SIZES, residual=residual)
    B, T = 4, 2048
    _, peak, _ = _run(config, checkpointing=kind, steps=3, B=B, T=T)
    estimate = training_memory(config, batch_size=B, seq_len=T, checkpointing=kind).peak
    print(f"{residual}, {kind}: measured {peak / 2**30:.2f} GiB, estimated {estimate / 2**30:.2f} GiB")
    assert abs(estimate - peak) <= MEMORY_MARGIN * peak, (peak, estimate)


def _fp8_capable() -> bool:
    return importlib.util.find_spec("torchao") is not None and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or not _fp8_capable(), reason="needs torchao and an Ada or Hopper GPU"
)


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_fp8_training_follows_bf16(recipe, mode):
    from torchao.float8.float8_linear import Float8Linear

    config = HybridConfig.from_preset("k3-scaled-block", **SIZES)
    bf16, _, _ = _run(config, mode=mode, steps=30, lr=2.0**-9)
    fp8, _, model = _run(config, fp8=recipe, mode=mode, steps=30, lr=2.0**-9)
    kda, mla = config.layer_types.count("kda"), config.layer_types.count("mla")
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 4 * kda + 3 * mla + 3 * (kda + mla)
    print(f"{recipe}, {mode}: bf16 {bf16[-1]:.4f}, fp8 {fp8[-1]:.4f}")
    assert all(math.isfinite(x) for x in fp8) and fp8[-1] < fp8[0] - 0.5  # it learns the repeated batches
    assert abs(fp8[-1] - bf16[-1]) <= 0.03 * bf16[-1], (bf16, fp8)


@needs_fp8
def test_train_fp8_runs_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--fp8", "--compile", "--out", out, "--steps", "3", "--batch-size", "2", "--seq-len", "256"]
    code, stdout, err = run_cli([*argv, "--eval-batches", "1", "--data-max-bytes", "200000"], capsys)
    assert code == 0, err
    assert "the large projections in FP8 with tensorwise scaling (--fp8)" in stdout + err
