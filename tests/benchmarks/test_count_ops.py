"""benchmarks/count_ops.py: every op of a training step is counted once and charged to a module, backward included,
and the KDA chunk op's ops are kept out of the layer rows."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.count_ops import _kind, count_step, summarize
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM


class _Plain(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.launches += _kind(func) == "aten"
        return func(*args, **(kwargs or {}))


def test_every_op_counted_once_and_charged_to_a_module():
    torch.manual_seed(0)
    config = HybridConfig.from_preset("tiny", residual="standard", layer_types=("kda", "mla"))
    model = HybridLM(config, kda_backend="torch").train()
    ids = torch.randint(0, config.vocab_size, (1, 16))
    counter = count_step(model, ids, torch.bfloat16)
    s = summarize(counter, config.layer_types)
    rows = s["rows"]
    assert "(untagged)" not in rows, rows.get("(untagged)")
    assert rows["layers.0.chunk_kda"]["bwd_launch"] > 0 and rows["layers.0.mixer"]["bwd_launch"] > 0

    # The same step under a plain mode: as many launching aten ops as the counter's total.
    model.zero_grad(set_to_none=True)
    plain = _Plain()
    with plain:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
    assert s["total"]["fwd_launch"] + s["total"]["bwd_launch"] == plain.launches

    # Layer rows leave the chunk op out; their sublayer rows add up to them.
    for i in range(2):
        subs = [g for g in rows if g.startswith(f"layers.{i}.") and not g.endswith("chunk_kda")]
        for k in ("fwd_launch", "bwd_launch"):
            assert sum(rows[g].get(k, 0) for g in subs) == rows[f"layers.{i}"][k], (i, k)
    assert s["per_type"]["kda"]["bwd_launch"] == rows["layers.0"]["bwd_launch"]


def test_a_prefill_chunk_is_counted_and_packed_projections_launch_fewer_kernels():
    from benchmarks.count_ops import count_prefill_chunk

    torch.manual_seed(0)
    config = HybridConfig.from_preset("tiny", residual="standard", layer_types=("kda", "mla", "kda"))
    model = HybridLM(config, kda_backend="torch").eval()
    launches, products = {}, {}
    for packed in (False, True):
        counter = count_prefill_chunk(model, prefix=40, chunk=24, packed=packed)
        s = summarize(counter, config.layer_types)
        assert s["total"].get("bwd_launch", 0) == 0 and s["rows"]["layers.1.mixer"]["fwd_launch"] > 0
        launches[packed] = s["total"]["fwd_launch"]
        products[packed] = counter.by_op["aten.mm"] + counter.by_op["aten.addmm"]
    # Each group of projections that read one input (KDA's six, MLA's, the MLP's two) becomes one product.
    groups = [m.packed_linears() for m in model.modules() if hasattr(type(m), "packed_linears")]
    assert products[False] - products[True] == sum(len(g) - 1 for g in groups), products
    assert launches[True] < launches[False], launches
