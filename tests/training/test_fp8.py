"""`train --fp8`: which linears torchao's float8 training converts (by name), that they compute the model's products
(emulated on the CPU), and that the flag is refused in one line, before anything is built, where it cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from hybrid_attention.config import HybridConfig
from hybrid_attention.layers import packed
from hybrid_attention.model import HybridLM
from hybrid_attention.training import fp8
from tests.helpers import run_cli

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")

# Per layer: KDA's q, k, v and output projections, Gated MLA's query, gate and output projections, the SwiGLU's three.
KDA = ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj")
MLA = ("mixer.q_proj", "mixer.g_proj", "mixer.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _model() -> HybridLM:
    config = HybridConfig.from_preset("tiny", vocab_size=96, layer_types=("kda", "mla"))
    return HybridLM(config)


def test_the_large_projections_are_chosen_by_name():
    expected = [f"layers.0.{n}" for n in KDA + MLP] + [f"layers.1.{n}" for n in MLA + MLP]
    assert fp8.fp8_linear_names(_model()) == expected
    # Never the embedding, the head, or the low-rank projections that make the gate, beta and MLA's latent rows.
    kept = {"lm_head", "layers.0.mixer.f_up", "layers.0.mixer.b_proj", "layers.1.mixer.kv_down", "layers.1.mixer.k_up"}
    assert not kept & set(expected)


@needs_torchao
def test_converted_linears_compute_the_products_in_fp8(monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model, reference = _model(), _model()
    reference.load_state_dict(model.state_dict())
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    names = fp8.convert_to_fp8(model, "tensorwise", emulate=True)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == names == fp8.fp8_linear_names(reference)
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys  # same tensors, same names
    # A group with a converted linear runs module by module where it would be one packed product (CUDA training).
    monkeypatch.setattr(packed, "use_triton", lambda x, **kw: True)
    x = torch.randn(2, 3, 64, requires_grad=True)
    assert packed.stack_in_training(x, reference.layers[0].mixer.packed_linears())
    assert not packed.stack_in_training(x, model.layers[0].mixer.packed_linears())
    monkeypatch.undo()
    calls = []
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: calls.append(name))
    ids = torch.randint(0, 96, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ref_loss = model(ids, labels=ids).loss, reference(ids, labels=ids).loss
    assert sorted(calls) == sorted(names)
    (loss + ref_loss).backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-2 * ref_loss.item()  # e4m3 products: a few percent per element
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, reference)]
    assert torch.isfinite(grads[0]).all() and F.cosine_similarity(*grads, dim=0) > 0.9


def test_refused_in_one_line_before_anything_is_built(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--fp8", "--device", "cpu", "--out", out, "--steps", "2"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    if importlib.util.find_spec("torchao") is not None:
        assert "--fp8 needs an NVIDIA GPU with FP8 tensor cores (Ada, Hopper or newer); this run is on cpu" in lines[0]
    assert not out.exists()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    code, _, err = run_cli(["train", "--fp8", "rowwise", "--device", "cpu", "--out", out], capsys)
    assert code == 1 and err.strip().endswith("pip install 'hybrid-attention[fp8]'") and "\n" not in err.strip()
    assert "not installed" in err and not out.exists()
    code, _, err = run_cli(["train", "--fp8", "columnwise"], capsys)
    assert code == 2 and "argument --fp8: invalid choice: 'columnwise'" in err
