"""act(a) * b in one kernel (`ops.act_mul`, Triton interpreter on CPU) against the eager ops, and a decode step
that uses it (SwiGLU, Gated MLA gate) against one that does not."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEV, assert_close, needs_triton

pytest.importorskip("triton")
from hybrid_attention.ops.act_mul import act_mul  # noqa: E402

pytestmark = needs_triton


@pytest.mark.parametrize("act, eager", [("silu", F.silu), ("sigmoid", torch.sigmoid)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_act_mul_equals_eager(act, eager, dtype):
    torch.manual_seed(0)
    packed = torch.randn(3, 2, 2 * 1100, device=DEV, dtype=dtype)  # two slices with a row stride, width > a block
    a, b = packed[..., :1100], packed[..., 1100:]
    y = act_mul(a, b, act)
    assert y.shape == a.shape and y.dtype == dtype and y.is_contiguous()
    assert_close(f"{act} * b", y, eager(a) * b, 1e-6 if dtype == torch.float32 else 1e-3)


def test_act_mul_rejects_bad_input():
    a = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="act must be one of"):
        act_mul(a, a, "gelu")
    with pytest.raises(ValueError, match="must match"):
        act_mul(a, a[:, :4], "silu")


def test_decode_step_with_act_mul(monkeypatch):
    """The layers take act_mul only inside a decode step on CUDA; here the CUDA check is lifted so the interpreter
    runs it, and the step must give the logits of a step without packing (which never takes it)."""
    import hybrid_attention.layers.packed as packed_mod
    import hybrid_attention.ops.act_mul as act_mod
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.inference.decode_graph import DecodeStep
    from hybrid_attention.model import HybridLM

    monkeypatch.setattr(packed_mod, "_act_mul_ok", lambda a, b: True)
    calls = []
    real = act_mod.act_mul
    monkeypatch.setattr(act_mod, "act_mul", lambda a, b, act: calls.append(act) or real(a, b, act))
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny"), kda_backend="torch").eval()
    ids = torch.randint(0, 256, (2, 4))
    logits = {}
    for pack in (True, False):
        step = DecodeStep(model, model.make_cache(2, 8), cuda_graph=False, pack_projections=pack)
        logits[pack] = torch.stack([step(ids[:, t]).clone() for t in range(ids.shape[1])], 1)
    n_mla = sum(t == "mla" for t in model.config.layer_types)
    assert calls.count("silu") == 4 * len(model.layers) and calls.count("sigmoid") == 4 * n_mla
    assert_close("decode step with act_mul", logits[True], logits[False], 1e-5)
