"""StackedMuon (hybrid_attention/training/muon.py) against torch.optim.Muon: the same update, with the matrices of one
shape orthogonalised in one stack; a device learning rate; state that moves between the two."""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_attention.training import muon
from hybrid_attention.training.muon import StackedMuon, newton_schulz
from hybrid_attention.training.optim import build_optimizers
from hybrid_attention.training.step import TrainStep

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

# Tall, wide and square matrices, shapes repeated in and across the two groups, one of odd sizes.
SHAPES = ([(24, 16), (16, 24), (24, 16), (32, 32), (37, 11)], [(16, 24), (32, 32), (8, 40)])


def _twins(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Two identical parameter sets (a list per group) with fresh random values."""
    g = torch.Generator().manual_seed(seed)
    first = [[torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes] for shapes in SHAPES]
    second = [[torch.nn.Parameter(p.detach().clone()) for p in group] for group in first]
    return first, second


def _groups(params, lrs=(0.02, 0.005)):
    return [{"params": group, "lr": lr} for group, lr in zip(params, lrs, strict=True)]


def _step_both(opt_a, a, opt_b, b, gen, *, skip=None):
    """The same fresh gradients on both twins, then a step of each optimizer."""
    _set_grads(a, b, gen, skip=skip)
    opt_a.step()
    opt_b.step()


def _set_grads(a, b, gen, *, skip=None):
    """The same fresh gradient on each twin; `skip` (an index into the flat list) gets none this step."""
    flat_a, flat_b = [p for g in a for p in g], [p for g in b for p in g]
    for i, (p, q) in enumerate(zip(flat_a, flat_b, strict=True)):
        grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad, q.grad = (None, None) if i == skip else (grad, grad.clone())


def _assert_bitwise(opt_a, a, opt_b, b):
    """For two runs of the same computation (StackedMuon with a float and with a device rate)."""
    for p, q in zip([p for g in a for p in g], [q for g in b for q in g], strict=True):
        assert torch.equal(p, q), (p.shape, (p - q).abs().max())
        if p in opt_a.state:
            assert torch.equal(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"])
        else:
            assert q not in opt_b.state


# The bfloat16 ulps by which a stacked product may differ from the per-matrix one in an entry of the update: whether a
# batched GEMM rounds as the single ones do depends on the CPU's kernels (equal on some CPUs, an ulp or two apart on
# others), and Newton-Schulz carries such a difference through its iterations.
NS_ULPS = 4


def _assert_close_to_torch(ref, a, ours, b, steps: int):
    """StackedMuon's parameters within `steps` updates' bfloat16 rounding of torch's, their momentum equal (the same
    lerp on the same gradients). An update entry is at most about 1.5 after Newton-Schulz, so each step may move a
    parameter by NS_ULPS ulps of 1.5 times the step size; a state on the wrong parameter moves it by the step size."""
    for group, ref_group in zip(ours.param_groups, ref.param_groups, strict=True):
        for p, q in zip(ref_group["params"], group["params"], strict=True):
            step = torch.optim._muon._adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape)
            ulp = torch.finfo(torch.bfloat16).eps * 1.5
            tol = steps * NS_ULPS * ulp * step + 2 * torch.finfo(p.dtype).eps * p.detach().abs().max()
            assert (p - q).abs().max() <= tol, (p.shape, (p - q).abs().max(), tol)
            if p in ref.state:
                assert torch.equal(ref.state[p]["momentum_buffer"], ours.state[q]["momentum_buffer"])
            else:
                assert q not in ours.state


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.05},
        {"adjust_lr_fn": "original", "momentum": 0.9, "ns_steps": 3},
    ],
)
@pytest.mark.parametrize("stack_elements", [muon.STACK_ELEMENTS, 600])  # 600: slices of one or two matrices
def test_stacked_step_equals_torch_muon(options, stack_elements, monkeypatch):
    monkeypatch.setattr(muon, "STACK_ELEMENTS", stack_elements)
    a, b = _twins()
    ref, ours = torch.optim.Muon(_groups(a), **options), StackedMuon(_groups(b), **options)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        _step_both(ref, a, ours, b, gen, skip=2 if step < 2 else None)  # without gradient: untouched, no state yet
        _assert_close_to_torch(ref, a, ours, b, step + 1)
    assert len(ours.state) == sum(len(s) for s in SHAPES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_parameter_dtypes_step_as_torch_muon(dtype):
    """Half parameters take the decay as torch's mul_ makes it and the update in float32, as torch's mixed add does
    (neither rounded to the half dtype first)."""
    a, b = _twins(9, dtype)
    ref, ours = torch.optim.Muon(_groups(a)), StackedMuon(_groups(b))
    gen = torch.Generator().manual_seed(10)
    for step in range(2):
        _step_both(ref, a, ours, b, gen)
        _assert_close_to_torch(ref, a, ours, b, step + 1)


def test_stack_orthogonalises_each_matrix_as_torch_does():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(2)
    for shape in [(5, 24, 16), (3, 16, 24), (2, 32, 32)]:
        updates = torch.randn(shape, generator=g) * 10
        coefficients = (3.4445, -4.7750, 2.0315)
        single = torch.stack([_zeropower_via_newtonschulz(u, coefficients, 5, 1e-7) for u in updates])
        stacked = newton_schulz(updates, coefficients, 5, 1e-7)
        assert stacked.dtype == torch.bfloat16 and stacked.shape == updates.shape
        ulp = torch.finfo(torch.bfloat16).eps * 2.0  # entries stay below 2
        assert (stacked.float() - single.float()).abs().max() <= NS_ULPS * ulp
        # Near orthogonal whatever the input's scale: the singular values end up around 1 (five steps leave the
        # smallest of a random square matrix lower).
        sv = torch.linalg.svdvals(stacked.double())
        assert sv.max() < 1.5 and 0.6 < sv.median() < 1.2, sv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.3, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"}])
def test_device_learning_rate_takes_the_float_step_bitwise(dtype, options):
    """A one-element tensor learning rate (what a CUDA graph reads) gives the float rate's step bitwise when float32
    holds the rate exactly: the decay and the scaled rate are computed in float64 as the float path computes them,
    and the update is one fused multiply-add as the float path's add is. (CPU's bfloat16 add rounds its scale to
    bfloat16 where CUDA's does not, so bfloat16 is compared on the GPU: tests/gpu/training/test_muon_gpu.py.)"""
    a, b = _twins(3, dtype)
    lrs = (2.0**-6, 3 * 2.0**-9)
    floats, tensors = StackedMuon(_groups(a, lrs), **options), StackedMuon(_groups(b, lrs), **options)
    for group in tensors.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    start = [p.detach().clone() for g in a for p in g]
    gen = torch.Generator().manual_seed(4)
    for factor in (1.0, 0.5, 1.0):  # the rate changes between steps, filled in place as before a replay
        for f, t, lr in zip(floats.param_groups, tensors.param_groups, lrs, strict=True):
            f["lr"] = lr * factor
            t["lr"].fill_(lr * factor)
        _step_both(floats, a, tensors, b, gen)
        _assert_bitwise(floats, a, tensors, b)
    assert all((p - p0).abs().max() > 1e-3 for p0, p in zip(start, [p for g in a for p in g], strict=True))


def test_device_learning_rate_rounds_only_the_rate():
    """A rate float32 does not hold (0.02) is rounded to float32 in the tensor: the step then differs from the float
    rate's by that rounding of the update's size, a few float32 ulps of the parameters."""
    a, b = _twins(3)
    floats, tensors = StackedMuon(_groups(a), weight_decay=0.1), StackedMuon(_groups(b), weight_decay=0.1)
    for group in tensors.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        _step_both(floats, a, tensors, b, gen)
    for p, q in zip([p for g in a for p in g], [q for g in b for q in g], strict=True):
        assert (p - q).abs().max() <= 4 * torch.finfo(torch.float32).eps * p.abs().max(), (p - q).abs().max()


def test_device_learning_rate_is_never_read_by_the_host():
    """What a CUDA graph needs: a step with a tensor learning rate reads no tensor back to the host (a read would
    stall the capture, and a replay would keep the value read then)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
                self.reads.append(func)
            return func(*args, **(kwargs or {}))

    params, _ = _twins(7)
    opt = StackedMuon(_groups(params), weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for group in opt.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    gen = torch.Generator().manual_seed(8)
    _set_grads(params, _twins(7)[1], gen)
    opt.step()  # the momentum buffers are made at the first step
    with HostReads() as mode:
        opt.step()
    assert mode.reads == []
    # The rate is read at each step: zero (filled in place, as before a replay) leaves the parameters where they are.
    before = [p.detach().clone() for g in params for p in g]
    for group in opt.param_groups:
        group["lr"].fill_(0.0)
    opt.step()
    assert all(torch.equal(p, p0) for p, p0 in zip([p for g in params for p in g], before, strict=True))


def test_state_moves_between_torch_muon_and_stacked():
    """A checkpoint of either optimizer continues in the other (the state is torch's): each momentum lands on its own
    parameter, and the runs go on as without the swap."""
    a, b = _twins(5)
    ref, ours = torch.optim.Muon(_groups(a)), StackedMuon(_groups(b))
    gen = torch.Generator().manual_seed(6)
    for step in range(4):
        _step_both(ref, a, ours, b, gen)
        if step == 1:  # swap through a checkpoint: each continues from the other's state
            ref_state, ours_state = copy.deepcopy(ref.state_dict()), copy.deepcopy(ours.state_dict())
            ref.load_state_dict(ours_state)
            ours.load_state_dict(ref_state)
            for i, q in enumerate(q for g in b for q in g):
                assert torch.equal(ours.state[q]["momentum_buffer"], ref_state["state"][i]["momentum_buffer"])
    _assert_close_to_torch(ref, a, ours, b, 4)


def test_launches_per_step_do_not_grow_with_the_matrix_count():
    """The point of the stack: the operators one step issues depend on the shapes, not on how many matrices share
    them (torch's Muon issues about twenty per matrix)."""

    def ops_per_step(count: int) -> int:
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(24, 16), (16, 16)] * count]
        opt = StackedMuon(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # the momentum buffers are made at the first step
        with torch.profiler.profile() as prof:
            opt.step()
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)

    few, many = ops_per_step(2), ops_per_step(16)
    assert few == many and many < 60, (few, many)


def test_bad_gradients_and_graph_support():
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = StackedMuon([p])
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(ValueError, match=r"StackedMuon: expected a dense real gradient, got torch.sparse_coo"):
        opt.step()
    # The training step accepts it for a CUDA graph (here refused only for the CPU parameters).
    model = torch.nn.Linear(4, 4)  # its weight for Muon, its bias for AdamW
    (muon_opt, adamw) = build_optimizers(_Model(model), optimizer="muon", lr=0.01, weight_decay=0.1)
    assert type(muon_opt) is StackedMuon and isinstance(adamw, torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs parameters on a CUDA device, got cpu"):
        TrainStep(lambda ids: ids.sum(), model.parameters(), [muon_opt, adamw], cuda_graph=True)
    # The sharded Muon reads its rate on the host: never captured.
    gathered = muon.GatheredMuon(muon_opt.param_groups, **muon_opt.defaults)
    with pytest.raises(ValueError, match=r"supports torch.optim.Adam, AdamW and StackedMuon only, got GatheredMuon"):
        TrainStep(lambda ids: ids.sum(), model.parameters(), [gathered, adamw], cuda_graph=True)


class _Model(torch.nn.Module):
    """The smallest model `build_optimizers` takes: a config with a vocabulary, one hidden matrix."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.config = type("Config", (), {"vocab_size": 1000})()
