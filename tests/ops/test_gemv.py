"""The decode GEMV kernel (`ops.gemv`, Triton interpreter on CPU) against F.linear, and a whole decode step that
routes its projections through it (`DecodeStep(gemv="triton")`) against one on F.linear."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEV, assert_as_accurate, assert_close, needs_cuda, needs_triton

pytest.importorskip("triton")
from hybrid_attention.ops.gemv import MAX_ROWS, gemv  # noqa: E402

pytestmark = needs_triton


@pytest.mark.parametrize("M, N, K", [(1, 37, 100), (3, 16, 300), (17, 70, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear_float32(M, N, K, bias):
    torch.manual_seed(M + N + K)
    x, w = torch.randn(M, K, device=DEV), torch.randn(N, K, device=DEV)
    b = torch.randn(N, device=DEV) if bias else None
    assert_close(
        "gemv", gemv(x, w, b), F.linear(x.double(), w.double(), None if b is None else b.double()).float(), 1e-6
    )


@pytest.mark.parametrize("case", ["fp32", pytest.param("bf16-k3", marks=needs_cuda)])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_every_gemv_config(index, case, monkeypatch):
    """Each autotune config alone (its BN, BK; the autotuner may pick any of them): in float32 at N and K that none
    of them divides, against float64; in bf16 at a k3-scaled shape (CUDA), as accurate as cuBLAS."""
    from hybrid_attention.ops import gemv as gemv_mod

    tuner = gemv_mod._gemv_kernel
    monkeypatch.setattr(tuner, "configs", [tuner.all_configs[index]])
    torch.manual_seed(index)
    if case == "fp32":
        x, w, b = torch.randn(2, 300, device=DEV), torch.randn(77, 300, device=DEV), torch.randn(77, device=DEV)
        ref = F.linear(x.double(), w.double(), b.double()).float()
        assert_close(f"gemv config {index}", gemv(x, w, b), ref, 1e-6)
    else:
        x = torch.randn(4, 2816, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1000, 2816, device="cuda", dtype=torch.bfloat16) * 2816**-0.5
        ref = F.linear(x.double(), w.double())
        assert_as_accurate(f"gemv config {index}", gemv(x, w), ref, F.linear(x, w), floor=2**-8)


def test_gemv_strided_rows_leading_dims_and_half_precision():
    torch.manual_seed(0)
    packed = torch.randn(2, 1, 96, device=DEV, dtype=torch.float16)
    x = packed[..., 16:80]  # a slice of a packed projection: row stride 96
    w = torch.randn(40, 64, device=DEV, dtype=torch.float16)
    y = gemv(x, w)
    assert y.shape == (2, 1, 40) and y.dtype == torch.float16
    assert_close("gemv fp16", y, F.linear(x.float(), w.float()), 2e-3)


def test_gemv_rejects_what_it_cannot_take():
    w = torch.randn(8, 16, device=DEV)
    with pytest.raises(ValueError, match="expected weight"):
        gemv(torch.randn(1, 12, device=DEV), w)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_ROWS + 1, 16, device=DEV), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.randn(1, 16, device=DEV, dtype=torch.float16), w)


def test_decode_step_through_the_gemv_equals_the_default(monkeypatch):
    """Every product of every step goes to the kernel with gemv="triton", none with gemv="torch"; same logits."""
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.inference.decode_graph import DecodeStep
    from hybrid_attention.model import HybridLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny"), kda_backend="torch").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_()
    ids = torch.randint(0, 256, (2, 5))
    import hybrid_attention.ops.gemv as gemv_mod

    calls = {"torch": [], "triton": []}
    real = gemv_mod.gemv
    logits = {}
    for mode in ("torch", "triton"):
        monkeypatch.setattr(gemv_mod, "gemv", lambda *a, mode=mode: calls[mode].append(1) or real(*a))
        step = DecodeStep(model, model.make_cache(2, 8), cuda_graph=False, gemv=mode)
        logits[mode] = torch.stack([step(ids[:, t]).clone() for t in range(ids.shape[1])], 1)
    # Every projection of every step: per layer the packed inputs, and the singles (KDA: f_up, g_up, o_proj; MLA:
    # o_proj, and q_up when q is low-rank; MLP: down), plus the head. MLA's k_up and v_up enter the absorbed attention
    # through their weights, never as a call.
    mla = [m for m in model.modules() if type(m).__name__ == "GatedMLA"]
    singles = (
        sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
        - sum(len(m.packed_linears()) for m in model.modules() if hasattr(type(m), "packed_linears"))
        - 2 * len(mla)
    )
    assert not calls["torch"] and len(calls["triton"]) == ids.shape[1] * (2 * len(model.layers) + singles)
    assert_close("decode step with the Triton GEMV", logits["triton"], logits["torch"], 1e-5)
    assert not any("forward" in vars(m) for m in model.modules())  # the singles' overrides are gone
    with pytest.raises(ValueError, match="gemv: backend must be one of"):
        DecodeStep(model, model.make_cache(2, 8), cuda_graph=False, gemv="cublas")
