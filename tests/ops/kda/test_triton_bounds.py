"""Every memory access of the Triton KDA kernels stays inside the tensors passed to that launch (Triton interpreter).

A GPU reports an access outside its allocations as an illegal address, and one inside a neighbouring buffer not at
all. Here the interpreter's loads and stores are checked element by element: each active address (mask true) must
fall inside one of the launch's own tensor arguments, between its first and its last element. Every buffer the
kernels allocate (through `torch.empty`) and every input is carved out of a larger allocation whose guard regions
on both sides hold NaN (float) or a sentinel (integer), so a stray address lands in no tensor and is reported, and
the guards are checked unchanged afterwards. Shapes: the real head size K = V = 128 (and 100 x 60, masked tiles), odd
lengths (two chunks, partial sub-chunks), varlen with an empty sequence, an initial state, the fused gates and
l2norm, both output paths, decays that send rows down the pair-by-pair path, NaN inputs, and every autotune config
of every kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.kda.cases import CONFIG_CASES, force_config, force_output_pass, make_inputs, triton_kda

if torch.cuda.is_available():
    pytest.skip("checks the Triton interpreter's accesses (CPU only)", allow_module_level=True)

import os  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from triton.runtime import interpreter  # noqa: E402


def int_sentinel(dtype: torch.dtype) -> int:
    """The guard value of an integer buffer (a float guard is NaN): an odd value no kernel writes."""
    return -(2**30) + 7 if torch.iinfo(dtype).bits >= 32 else torch.iinfo(dtype).min + 7


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, one past the last byte) of the elements of t, or None when it has none."""
    if t.numel() == 0:
        return None
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


class AccessChecker:
    """Records the tensor arguments of every interpreted launch and checks each load and store against them."""

    def __init__(self):
        self.kernel = None
        self.ranges: list[tuple[int, int, str]] = []
        self.violations: list[str] = []
        self.launches: set[str] = set()
        self.guards: list[tuple[torch.Tensor, int, int]] = []  # (base, start, end) of every carved tensor

    def install(self, monkeypatch):
        checker = self
        real_init = interpreter.GridExecutor._init_args_hst

        def init_args(executor, args_dev, kwargs):
            args_hst, kwargs_hst = real_init(executor, args_dev, kwargs)
            names = executor.arg_names
            ranges = []
            for name, arg in [*zip(names, args_hst, strict=False), *kwargs_hst.items()]:
                if isinstance(arg, torch.Tensor) and (ext := _extent(arg)) is not None:
                    ranges.append((*ext, name))
            checker.kernel = executor.fn.__name__
            checker.launches.add(checker.kernel)
            checker.ranges = ranges
            return args_hst, kwargs_hst

        def check(ptrs, mask, what):
            p = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
            m = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).reshape(-1)
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            p = p[m]
            if p.size == 0:
                return
            inside = np.zeros(p.shape, dtype=bool)
            for lo, hi, _ in checker.ranges:
                inside |= (p >= np.uint64(lo)) & (p + np.uint64(size) <= np.uint64(hi))
            if not inside.all():
                bad = p[~inside]
                near = min(checker.ranges, key=lambda r: min(abs(int(bad[0]) - r[0]), abs(int(bad[0]) - r[1])))
                checker.violations.append(
                    f"{checker.kernel}: {what} of {bad.size} element(s) outside its tensors, e.g. at byte "
                    f"{int(bad[0]) - near[0]:+d} from the start of {near[2]!r} ({near[1] - near[0]} bytes long)"
                )

        real_load = interpreter.InterpreterBuilder.create_masked_load
        real_store = interpreter.InterpreterBuilder.create_masked_store

        def masked_load(builder, ptrs, mask, other, cache_policy, is_volatile):
            check(ptrs, mask, "load")
            return real_load(builder, ptrs, mask, other, cache_policy, is_volatile)

        def masked_store(builder, ptrs, value, mask, cache_policy):
            check(ptrs, mask, "store")
            return real_store(builder, ptrs, value, mask, cache_policy)

        monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", init_args)
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", masked_load)
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", masked_store)

        real_empty = torch.empty

        def guarded_empty(*args, **kwargs):
            return checker.carve(real_empty(*args, **kwargs), real_empty)

        # torch.compile's table of torch functions is built from torch's attributes when first needed: build it
        # from the real ones (see tests/kda_triton_cases.poison_torch_empty).
        torch._dynamo.trace_rules.get_torch_obj_rule_map()
        monkeypatch.setattr(torch, "empty", guarded_empty)

    def carve(self, like: torch.Tensor, alloc=torch.empty) -> torch.Tensor:
        """A contiguous tensor shaped like `like` (same dtype, uninitialised) inside a guarded allocation: at least
        4 KiB and the tensor's own size of guard on each side."""
        if like.dtype == torch.bool or like.device.type != "cpu":
            return like
        n = like.numel()
        pad = max(4096 // like.element_size(), n)
        base = alloc(n + 2 * pad, dtype=like.dtype)
        base.fill_(float("nan") if base.is_floating_point() else int_sentinel(base.dtype))
        out = alloc(0, dtype=like.dtype).set_(base.untyped_storage(), pad, like.shape, like.stride())
        self.guards.append((base, pad, pad + n))
        return out

    def guarded_copy(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        out = self.carve(x)
        out.copy_(x)
        return out

    def assert_clean(self):
        assert not self.violations, "\n".join(dict.fromkeys(self.violations))
        for base, start, end in self.guards:
            for part in (base[:start], base[end:]):
                ok = part.isnan().all() if base.is_floating_point() else (part == int_sentinel(base.dtype)).all()
                assert ok, "a guard region next to a kernel buffer was written"


@pytest.fixture
def checker(monkeypatch):
    c = AccessChecker()
    c.install(monkeypatch)
    return c


def run_guarded(checker, inputs, *, backward=True, **kw):
    """Forward (and backward) of triton_kda on guarded copies of the inputs; returns o, S and the gradients."""
    leaves = [checker.guarded_copy(x) for x in inputs]
    if backward:
        leaves = [None if x is None else x.requires_grad_() for x in leaves]
    with torch.set_grad_enabled(backward):
        o, S = triton_kda(*leaves, **kw)
    grads = {}
    if backward:
        gen = torch.Generator().manual_seed(3)
        do = checker.guarded_copy(torch.randn(o.shape, generator=gen).to(o.dtype))
        dS = checker.guarded_copy(torch.randn(S.shape, generator=gen))
        used = [x for x in leaves if x is not None]
        grads = torch.autograd.grad((o, S), used, (do, dS))
    return o, S, grads


def _extreme(g: torch.Tensor) -> torch.Tensor:
    """Ordinary decays with whole tokens at -1000 and single channels at -50: pair-by-pair rows in every chunk."""
    gen = torch.Generator().manual_seed(5)
    g = -5.0 * torch.rand(g.shape, generator=gen)
    g[:, torch.rand(g.shape[1], generator=gen) < 0.1] = -1000.0
    g[torch.rand(g.shape, generator=gen) < 0.05] = -50.0
    return g


CASES = {
    # name: (B, T, H, N or None, cu_seqlens or None, options)
    "B2-T67-gate-l2norm": (2, 67, 1, None, None, dict(gate=True, l2norm=True)),
    "varlen-empty": (1, 150, 1, 4, [0, 67, 67, 131, 150], dict()),
    "softplus-K100-V60": (1, 67, 1, None, None, dict(gate="softplus", l2norm=True, K=100, V=60)),
    "decays-to-1000": (1, 67, 1, None, None, dict(extreme=True)),
}


@pytest.mark.parametrize("output_pass", ["walk", "split"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_access_in_bounds_at_head_size_128(checker, monkeypatch, case, output_pass):
    force_output_pass(monkeypatch, output_pass == "split")
    B, T, H, N, cu, opts = CASES[case]
    gate, l2norm = opts.get("gate", False), opts.get("l2norm", False)
    K, V = opts.get("K", 128), opts.get("V", 128)
    inputs = list(make_inputs(B, T, H, K, V, N=N, gate=gate, l2norm=l2norm, seed=T))
    if opts.get("extreme"):
        inputs[3] = _extreme(inputs[3])
    kw = dict(l2norm=l2norm, form=gate if isinstance(gate, str) else "bounded")
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu)
    o, S, grads = run_guarded(checker, inputs, **kw)
    checker.assert_clean()
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(x).all() for x in grads)
    expected = {
        "_prep_kernel",
        "_prep_redo_kernel",
        "_state_fwd_kernel",
        "_regate_kernel",
        "_state_bwd_kernel",
        "_score_grad_kernel",
        "_dqkg_kernel",
    }
    assert expected <= checker.launches


@pytest.mark.parametrize("kernel, index", CONFIG_CASES, ids=[f"{n}-{i}" for n, i in CONFIG_CASES])
def test_every_autotune_config_in_bounds(checker, monkeypatch, kernel, index):
    """Each config alone at K = V = 128 (its tiles, e.g. BV = 128, over the whole state), varlen."""
    force_config(monkeypatch, kernel, index)
    inputs = make_inputs(1, 70, 1, 128, 128, N=2, gate=True, l2norm=True, seed=index)
    run_guarded(checker, inputs, l2norm=True, cu_seqlens=torch.tensor([0, 5, 70]))
    checker.assert_clean()


def test_poisoned_inputs_stay_in_bounds(checker):
    """NaN in the inputs (the kernels then branch on the first non-finite row): no access moves."""
    inputs = list(make_inputs(1, 67, 1, 128, 128, gate=True, l2norm=True, seed=11))
    inputs[2] = inputs[2].clone()
    inputs[2][0, 50, 0, 5] = float("nan")
    inputs[1] = inputs[1].clone()
    inputs[1][0, 20, 0, 7] = float("inf")
    o, _, _ = run_guarded(checker, inputs, backward=False, l2norm=True)
    checker.assert_clean()
    assert torch.isfinite(o[:, :20]).all() and not torch.isfinite(o[:, 20:]).any()
