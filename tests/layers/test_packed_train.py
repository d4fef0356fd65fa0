"""The training path of `layers.packed.project`: one matmul over a layer's input projections (taken on CUDA; here
the rule is lifted so that it runs on CPU) gives the separate projections' output and gradients, in one matmul, and
autograd keeps none of the packed product."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybrid_attention.layers.packed as packed_mod
from hybrid_attention.layers import GatedMLA, KimiDeltaAttention
from tests.helpers import assert_close

F64 = torch.float64


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def _layers():
    torch.manual_seed(0)
    yield KimiDeltaAttention(48, 2, head_dim=16, backend="torch").double()
    yield GatedMLA(48, 2, kv_lora_rank=16, qk_nope_head_dim=8, qk_shared_head_dim=8, v_head_dim=16).double()


@pytest.mark.parametrize("layer", list(_layers()), ids=["kda", "mla"])
def test_stacked_projections_match_the_separate_ones(layer, monkeypatch):
    x = torch.randn(2, 7, 48, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 7, 48, dtype=F64)
    widths = [lin.out_features for lin in layer.packed_linears()]
    results, matmuls, saved = {}, {}, {}
    for stacked in (True, False):
        monkeypatch.setattr(packed_mod, "use_triton", lambda x, stacked=stacked, **kw: stacked)
        sizes = saved[stacked] = []
        counter = _Matmuls()

        def pack(t, sizes=sizes):
            sizes.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
            y = layer(x)
        matmuls[stacked] = counter.count
        results[stacked] = (y, *torch.autograd.grad(y, [x, *layer.parameters()], dy))
    names = ["y", "x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, results[True], results[False], strict=True):
        assert_close(name, a, b, 1e-13)
    assert matmuls[True] == matmuls[False] - (len(widths) - 1)
    packed_bytes = x.shape[0] * x.shape[1] * sum(widths) * 8
    assert packed_bytes not in saved[True]  # the packed product is not kept, only the columns each consumer needs
    assert sum(saved[True]) <= sum(saved[False]) + sum(lin.weight.numel() for lin in layer.packed_linears()) * 8


def test_without_gradients_the_projections_stay_separate(monkeypatch):
    monkeypatch.setattr(packed_mod, "use_triton", lambda x, **kw: True)
    layer = next(_layers())
    counter = _Matmuls()
    with torch.no_grad(), counter:
        layer(torch.randn(1, 3, 48, dtype=F64))
    layer_grad = _Matmuls()
    with layer_grad:
        layer(torch.randn(1, 3, 48, dtype=F64))
    assert counter.count == layer_grad.count + len(layer.packed_linears()) - 1
