"""Shared by the CPU (interpreter) and GPU tests of the Triton KDA kernels: one call convention for our op and the
float64 reference, and a helper that returns outputs and every input gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_attention.ops.kda import kda_gate, recurrent_kda
from hybrid_attention.ops.triton_support import triton_available
from tests.helpers import DEV

# Positional inputs of `triton_kda` and `reference_kda`, in order; None entries are skipped.
NAMES = ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")


def make_inputs(B, T, H, K, V, *, N=None, h0=True, gate=False, l2norm=False, dtype=torch.float32, seed=0, device=DEV):
    """q, k unit vectors (raw Gaussians when the kernel normalises), g in (-5, 0) (raw logits z with a gate: True or
    "bounded", or "softplus"), beta in (0, 1), a random float32 start state; A_log and dt_bias as the layer
    initialises them, perturbed ("softplus": A_log = log of uniform [1, 16], so decays reach far below -5).
    Drawn in float64 on the CPU from `seed` (the same numbers on every machine), then cast and moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if gate:
        g = 2 * rnd(B, T, H, K)
        A_log = 0.3 * rnd(H)
        if gate == "softplus":
            A_log = torch.log(1.0 + 15.0 * torch.rand(H, generator=gen, dtype=torch.float64))
        dt = torch.exp(-6.9 + 4.6 * torch.rand(H * K, generator=gen, dtype=torch.float64))  # in [1e-3, 1e-1]
        dt_bias = torch.log(torch.expm1(dt))  # inverse softplus
    else:
        g = -5 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
        A_log = dt_bias = None
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = rnd(B if N is None else N, H, K, V).float() if h0 else None
    x = [t.to(dtype).to(device) for t in (q, k, rnd(B, T, H, V), g, beta)]
    extra = [None if t is None else t.float().to(device) for t in (A_log, dt_bias)]
    return x + [None if h0 is None else h0.to(device)] + extra


def extreme_decays(shape, seed=0) -> torch.Tensor:
    """float64 log decays [B, T, H, K] in (-5, 0) with whole tokens at -1000 (masked tokens, as FLA's tests use) and
    single channels at -50 and -12: far below what the anchored sub-chunk dots can span."""
    gen = torch.Generator().manual_seed(seed)
    g = -5.0 * torch.rand(shape, generator=gen, dtype=torch.float64)
    g[:, torch.rand(shape[1], generator=gen) < 0.03] = -1000.0
    g[torch.rand(shape, generator=gen) < 0.05] = -50.0
    g[torch.rand(shape, generator=gen) < 0.05] = -12.0
    return g


def run(fn, inputs, do, dS, **kw):
    """o, S and the gradients of loss = <o, do> + <S, dS> w.r.t. every input that is not None."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves, **kw)
    loss = (o.double() * do).sum() + (S.double() * dS).sum()
    used = [(n, x) for n, x in zip(NAMES, leaves, strict=True) if x is not None]
    grads = torch.autograd.grad(loss, [x for _, x in used])
    return o, S, {n: gr for (n, _), gr in zip(used, grads, strict=True)}


def _gate_kwargs(form, A_log, dt_bias, lower_bound):
    if A_log is None:
        return {}
    return dict(gate=form, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound if form == "bounded" else None)


def triton_kda(q, k, v, g, beta, h0, A_log, dt_bias, *, l2norm=False, cu_seqlens=None, form="bounded",
               lower_bound=-5.0):  # fmt: skip
    """Our kernels; with A_log, g is the raw gate logit of the gate `form` (bounded: at least `lower_bound`)."""
    from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton

    gate = _gate_kwargs(form, A_log, dt_bias, lower_bound)
    return chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
                            use_qk_l2norm=l2norm, **gate)  # fmt: skip


def reference_kda(q, k, v, g, beta, h0, A_log, dt_bias, *, l2norm=False, cu_seqlens=None, form="bounded",
                  lower_bound=-5.0):  # fmt: skip
    """recurrent_kda in float64, with the gate and the l2norm written out in torch."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if l2norm:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    if A_log is not None:
        g = kda_gate(g, A_log.double(), dt_bias.double(), lower_bound if form == "bounded" else None, form=form)
    h0 = None if h0 is None else h0.double()
    return recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)


def poison_torch_empty(monkeypatch) -> None:
    """Make every floating `torch.empty` (all the kernels' buffers come from it) start as NaN, so an element a
    kernel forgets to write shows up in the comparison."""
    real_empty = torch.empty
    # torch.compile's table of torch functions is built once, from torch's attributes at that moment: build it now,
    # from the real ones, or a later compile in this process would meet a torch.empty it does not know.
    torch._dynamo.trace_rules.get_torch_obj_rule_map()

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)


def changed_after(base: list, other: list, t: int) -> list:
    """`base` inputs (q, k, v, g, beta, then the rest) with q..beta taken from `other` at positions after t."""
    changed = [x.clone() for x in base[:5]]
    for x, y in zip(changed, other[:5], strict=True):
        x[:, t + 1 :] = y[:, t + 1 :]
    return changed + list(base[5:])


def autotuned_kernels() -> dict:
    """Every autotuned KDA kernel by name (the output pass runs only when `split_output` says so); each tuner lists
    its configs in `all_configs`."""
    from hybrid_attention.ops.kda.kernels import dqkg, output, prep, score_grad, state_bwd, state_fwd

    return {
        "prep": prep._prep_kernel,
        "state_fwd": state_fwd._state_fwd_kernel,
        "output": output._output_kernel,
        "state_bwd": state_bwd._state_bwd_kernel,
        "score_grad": score_grad._score_grad_kernel,
        "dqkg": dqkg._dqkg_kernel,
    }


def force_output_pass(monkeypatch, split: bool) -> None:
    """Compute O inside the state walk (split False) or in the separate output pass (True), whatever the size."""
    from hybrid_attention.ops.kda import chunk_fwd

    monkeypatch.setattr(chunk_fwd, "split_output", lambda pairs: split)


def force_config(monkeypatch, kernel: str, index: int):
    """Run `kernel` with its config `index` alone (the autotuner runs a single config directly), with O in the
    output pass when that kernel is the output pass and inside the state walk otherwise; returns the config."""
    tuner = autotuned_kernels()[kernel]
    monkeypatch.setattr(tuner, "configs", [tuner.all_configs[index]])
    force_output_pass(monkeypatch, kernel == "output")
    return tuner.all_configs[index]


# Every config of every autotuned kernel, and every one but the first (the first runs in all other tests). Empty
# without triton, so that importing these cases stays possible there (the test modules then skip).
ALL_CONFIG_CASES = (
    [(n, i) for n, kernel in autotuned_kernels().items() for i in range(len(kernel.all_configs))]
    if triton_available()
    else []
)
CONFIG_CASES = [(n, i) for n, i in ALL_CONFIG_CASES if i > 0]
