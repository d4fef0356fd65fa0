"""A training step through the CUDA fast paths of the standard-residual model (the fused RMSNorm, the stacked
projections, the fused SwiGLU; here under the Triton interpreter, the rule lifted to CPU tensors) gives the
reference path's loss and gradients, eager and under `torch.compile(fullgraph=True)`."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import hybrid_attention.ops.backends as backends
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.triton_support import triton_runs_on
from tests.helpers import DEV, assert_close, needs_triton

pytestmark = [needs_triton, pytest.mark.skipif(DEV == "cuda", reason="the CPU stand-in for the CUDA path")]
pytest.importorskip("triton")
import hybrid_attention.ops.rms_norm as rms_norm_mod  # noqa: E402
import hybrid_attention.ops.swiglu as swiglu_mod  # noqa: E402


def _step(model, ids, fn=None):
    model.zero_grad(set_to_none=True)
    loss = (fn or (lambda ids: model(ids, labels=ids, return_logits=False).loss))(ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fast_training_step_matches_the_reference(monkeypatch):
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", residual="standard", layer_types=("mla", "mla")))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    ref_loss, ref = _step(model, ids)
    monkeypatch.setattr(backends, "triton_runs_on", lambda x, cpu_interpreter=False: triton_runs_on(x))
    calls = Counter()
    for mod, name in ((rms_norm_mod, "rms_norm_fused"), (swiglu_mod, "swiglu_down")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name: calls.update([name]) or real(*a))
    _step(model, ids)
    assert calls == {"rms_norm_fused": 7, "swiglu_down": 2}, calls  # 3 norms per MLA layer and the final one
    for label, fn in (
        ("eager", None),
        ("compiled", torch.compile(lambda ids: model(ids, labels=ids, return_logits=False).loss, fullgraph=True,
                                   backend="aot_eager")),
    ):  # fmt: skip
        loss, grads = _step(model, ids, fn)
        assert_close(f"{label} loss", loss, ref_loss, 1e-6)
        for name, g in ref.items():
            assert_close(f"{label} d {name}", grads[name], g, 1e-5)
