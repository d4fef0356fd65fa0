"""Packed decode projections (layers/packed.py): one product over concatenated weights equals the separate
projections; every KDA, Gated MLA and SwiGLU layer is covered; a decode step passes them to the model call and
installs nothing on the modules; a decode step with them equals one without and the full forward."""

import pytest
import torch
from torch import nn

from hybrid_attention.config import HybridConfig
from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.generate import generate
from hybrid_attention.layers import GatedMLA, KimiDeltaAttention, SwiGLU
from hybrid_attention.layers.packed import PackedLinear, PackedProjections
from hybrid_attention.model import HybridLM
from tests.helpers import assert_close


def tiny_model(dtype=torch.float64) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny"), kda_backend="torch").to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):  # non-trivial AttnRes mixing
                p.normal_()
    return model


def test_packed_linear_equals_the_separate_projections():
    torch.manual_seed(1)
    linears = [nn.Linear(24, n, bias=False).double() for n in (16, 3, 0, 40)]  # a zero-width one (d_s = 0)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    outs = PackedLinear(linears)(x)
    assert len(outs) == 4
    for lin, out in zip(linears, outs, strict=True):
        ref = lin(x)
        assert out.shape == ref.shape
        if ref.numel():
            assert_close(f"packed output of width {lin.out_features}", out, ref, 1e-14)


def test_packed_linear_with_a_bias_and_bad_input():
    torch.manual_seed(2)
    linears = [nn.Linear(8, 4, bias=False).double(), nn.Linear(8, 6, bias=True).double()]
    x = torch.randn(3, 8, dtype=torch.float64)
    for lin, out in zip(linears, PackedLinear(linears)(x), strict=True):
        assert_close(f"packed output of width {lin.out_features}", out, lin(x), 1e-14)
    with pytest.raises(ValueError, match="at least one"):
        PackedLinear([])
    with pytest.raises(ValueError, match="input widths differ"):
        PackedLinear([nn.Linear(8, 4, bias=False), nn.Linear(6, 4, bias=False)])


def test_every_mixer_and_mlp_is_packed():
    model = tiny_model()
    packed = PackedProjections(model)
    kinds = (KimiDeltaAttention, GatedMLA, SwiGLU)
    expected = {m for m in model.modules() if isinstance(m, kinds)}
    assert set(packed.by_module) == expected and len(expected) == 2 * len(model.layers)
    n_params = sum(lin.weight.numel() for m in expected for lin in m.packed_linears())
    assert packed.nbytes() == n_params * 8
    with pytest.raises(ValueError, match="no packed weights for this SwiGLU"):
        packed.inputs(tiny_model().layers[0].mlp, torch.zeros(1, 1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="gemv: backend must be one of"):
        PackedProjections(model, gemv="cublas")


def test_decode_step_with_packing_equals_without_and_the_full_forward(monkeypatch):
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 9))
    calls = []
    packed_call = PackedLinear.__call__
    monkeypatch.setattr(PackedLinear, "__call__", lambda self, x: calls.append(1) or packed_call(self, x))
    attributes = {name: {k: id(v) for k, v in vars(m).items()} for name, m in model.named_modules()}
    logits = {}
    for pack in (True, False):
        cache = model.make_cache(2, 16)
        step = DecodeStep(model, cache, cuda_graph=False, pack_projections=pack)
        assert (step.packed is not None) == pack
        logits[pack] = torch.stack([step(ids[:, t]).clone() for t in range(ids.shape[1])], 1)
    assert len(calls) == ids.shape[1] * 2 * len(model.layers)  # every mixer and MLP, every packed step
    with torch.no_grad():
        full = model(ids).logits
    assert len(calls) == ids.shape[1] * 2 * len(model.layers)  # a plain call does not use them
    assert_close("packed decode vs unpacked", logits[True], logits[False], 1e-12)
    assert_close("packed decode vs full forward", logits[True], full, 1e-10)
    assert {name: {k: id(v) for k, v in vars(m).items()} for name, m in model.named_modules()} == attributes


def test_packed_copies_are_a_snapshot_the_parameters_stay_separate():
    """The step's copies are taken when it is built (its contract: the weights do not change while it is used);
    the parameters are not replaced or aliased, so training and checkpoints are unaffected."""
    model = tiny_model()
    before = {name: p for name, p in model.named_parameters()}
    step = DecodeStep(model, model.make_cache(1, 4), cuda_graph=False)
    assert {name: p for name, p in model.named_parameters()} == before
    kda = model.layers[0].mixer
    packed_q = step.packed.by_module[kda].weight[: kda.q_proj.out_features]
    assert torch.equal(packed_q, kda.q_proj.weight)
    assert packed_q.data_ptr() != kda.q_proj.weight.data_ptr()


def test_generate_with_and_without_packing(monkeypatch):
    """generate(model, pack_projections=False) builds no packed copies and gives the same greedy tokens."""
    model = tiny_model()
    built = []
    init = PackedProjections.__init__
    monkeypatch.setattr(PackedProjections, "__init__", lambda self, *a: built.append(1) or init(self, *a))
    prompt = torch.randint(0, 256, (2, 6))
    packed = generate(model, prompt, 8, temperature=0)
    assert len(built) == 1
    plain = generate(model, prompt, 8, temperature=0, pack_projections=False)
    assert len(built) == 1 and torch.equal(packed, plain)
