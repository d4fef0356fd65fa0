"""The fused AttnRes kernels on CUDA at k3-scaled widths, as accurate against float64 as the bf16 PyTorch
composition: the inference kernel (`ops.attnres.mix_norm`) at decode (1 row) and prefill (4096 rows) sizes, which take
different launch shapes, and the training ops (`ops.attnres.mix_norm_grad`: Full AttnRes + RMSNorm alone;
`ops.attnres.full_stream`: a Full AttnRes stream; `ops.attnres.block_stream`: Block AttnRes phase 1 and phase 2 +
RMSNorm) at B=8, T=2048, D=1024 (the stream at B=1), outputs and every gradient. Run:
`python -m pytest -q tests/gpu/ops/attnres/test_attnres_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.attnres import triton_block_merge, triton_block_partial, triton_mix_norm, triton_stream_bwd
from hybrid_attention.ops.attnres.mix_norm import attn_res_norm
from hybrid_attention.ops.attnres.triton_block_merge import MERGE_BWD_CONFIGS
from hybrid_attention.ops.attnres.triton_block_partial import PARTIAL_BWD_BLOCKS, PARTIAL_BWD_WARPS
from hybrid_attention.ops.attnres.triton_mix_norm import FULL_FWD_CONFIGS
from hybrid_attention.ops.attnres.triton_stream_bwd import STREAM_BWD_CONFIGS, STREAM_LOCAL_CONFIGS
from tests.helpers import assert_as_accurate

# Tuned: the stream test compares the autotuned launch shapes with each config alone (tests/gpu/conftest.py).
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.tuned]


def only_config(monkeypatch, config: tuple[str, int]) -> None:
    """Tune the AttnRes kernel named config[0] over its config number config[1] alone."""
    name, index = config
    module = next(
        m for m in (triton_mix_norm, triton_stream_bwd, triton_block_partial, triton_block_merge) if hasattr(m, name)
    )
    tuner = getattr(module, name)
    monkeypatch.setattr(tuner, "configs", [tuner.all_configs[index]])


@pytest.mark.parametrize("rows", [1, 4096])
@pytest.mark.parametrize("S", [1, 14, 27])
def test_fused_attn_res_norm_at_model_widths(rows, S):
    D = 1024
    g = torch.Generator("cuda").manual_seed(S * rows)
    buf = torch.full((S + 2, 1, rows, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    scales = torch.rand(S, 1, 1, 1, device="cuda", generator=g) * 4 + 0.1
    buf[:S] = (torch.randn(S, 1, rows, D, device="cuda", generator=g) * scales).bfloat16()
    latest = buf[S - 1].clone()
    buf[S - 1] = float("nan")  # must come from `latest`
    query = torch.randn(D, device="cuda", generator=g) * 2 * D**-0.5
    key_w, norm_w = (0.5 + torch.rand(D, device="cuda", generator=g) for _ in range(2))
    args = dict(norm_weight=norm_w, norm_eps=1e-6)
    out = attn_res_norm(buf[:S], query, key_w, 1e-6, latest=latest, backend="triton", **args)
    assert torch.equal(buf[S - 1], latest) and torch.isnan(buf[S:]).all()
    src64 = buf[:S].double()
    ref = attn_res_norm(
        src64,
        query.double(),
        key_w.double(),
        1e-6,
        backend="torch",
        **{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in args.items()},
    )
    plain = attn_res_norm(buf[:S].clone(), query, key_w, 1e-6, backend="torch", **args)
    assert_as_accurate(f"attn_res_norm rows={rows} S={S}", out, ref, plain, floor=2**-8)


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _grads(out, inputs, cot):
    return torch.autograd.grad(out, inputs, cot.to(out.dtype))


def _sources(n, B, T, D, g):
    scales = torch.rand(n, device="cuda", generator=g) * 4 + 0.1
    return [(torch.randn(B, T, D, device="cuda", generator=g) * scales[i]).bfloat16() for i in range(n)]


@pytest.mark.parametrize("S", [2, 27])
def test_fused_training_full_at_model_sizes(S):
    """Full AttnRes + RMSNorm forward and every gradient at B=8, T=2048, D=1024, bf16 sources: as accurate against
    float64 as the bf16 reference composition."""
    from hybrid_attention.ops.attnres.mix_norm_grad import attn_res_norm_train
    from hybrid_attention.ops.attnres.naive import naive_attn_res
    from hybrid_attention.ops.numerics import rms_norm

    B, T, D = 8, 2048, 1024
    g = torch.Generator("cuda").manual_seed(S)
    src = _sources(S, B, T, D, g)
    params = [torch.randn(D, device="cuda", generator=g) * 2 * D**-0.5]
    params += [0.5 + torch.rand(D, device="cuda", generator=g) for _ in range(2)]
    cot = torch.randn(B, T, D, device="cuda", generator=g)
    results = {}
    for name, dtype in (("fused", None), ("plain", None), ("ref", torch.float64)):
        s_in = _leaves([s if dtype is None else s.to(dtype) for s in src])
        p_in = _leaves([p if dtype is None else p.to(dtype) for p in params])
        if name == "fused":
            out = attn_res_norm_train(s_in, *p_in, 1e-6, 1e-6)
        else:
            out = rms_norm(naive_attn_res(s_in, p_in[0], p_in[1], 1e-6), p_in[2], 1e-6)
        results[name] = (out.detach(), _grads(out, s_in + p_in, cot))
        del out, s_in, p_in
    (fo, fg), (po, pg), (ro, rg) = results["fused"], results["plain"], results["ref"]
    assert_as_accurate(f"full S={S} out", fo, ro, po, floor=2**-8)
    labels = [f"source {i}" for i in range(S)] + ["query", "key_weight", "norm_weight"]
    for label, f, p, r in zip(labels, fg, pg, rg, strict=True):
        assert_as_accurate(f"full S={S} d {label}", f, r, p, floor=2**-8)


# Each config of the Block AttnRes kernels alone, (kernel, index into its config list).
BLOCK_CONFIGS = [
    *[("_partial_bwd_kernel", i) for i in range(len(PARTIAL_BWD_WARPS))],
    *[("_merge_norm_bwd_kernel", i) for i in range(len(MERGE_BWD_CONFIGS))],
]


@pytest.mark.parametrize(
    "N, config",
    [(1, None), (8, None), (PARTIAL_BWD_BLOCKS + 3, None), *[(7, c) for c in BLOCK_CONFIGS]],
    ids=lambda v: "tuned" if v is None else v if isinstance(v, int) else f"{v[0]}-{v[1]}",
)
def test_fused_training_block_at_model_sizes(N, config, monkeypatch):
    """Block AttnRes phase 1 (4 queries over N blocks) then phase 2 + RMSNorm on one query, at B=8, T=2048, D=1024,
    bf16 blocks: as accurate against float64 as the bf16 reference composition, outputs and every gradient; with the
    tuned launch shapes (N past PARTIAL_BWD_BLOCKS: the row-at-a-time phase-1 backward) and with each config
    alone."""
    from hybrid_attention.ops.attnres.block_stream import attn_res_merge_norm_train, attn_res_partial_train
    from hybrid_attention.ops.attnres.naive import naive_attn_res_merge, naive_attn_res_partial
    from hybrid_attention.ops.numerics import rms_norm

    if config is not None:
        only_config(monkeypatch, config)
    B, T, D, Q = 8, 2048, 1024, 4
    g = torch.Generator("cuda").manual_seed(N)
    blk = _sources(N + 1, B, T, D, g)  # the last one is the partial sum
    queries = torch.randn(Q, D, device="cuda", generator=g) * 2 * D**-0.5
    key_ws, norm_w = 0.5 + torch.rand(Q, D, device="cuda", generator=g), 0.5 + torch.rand(D, device="cuda", generator=g)
    cot = torch.randn(B, T, D, device="cuda", generator=g)
    results = {}
    for name, dtype in (("fused", None), ("plain", None), ("ref", torch.float64)):
        b_in = _leaves([b if dtype is None else b.to(dtype) for b in blk])
        p_in = _leaves([p if dtype is None else p.to(dtype) for p in (queries, key_ws, norm_w)])
        qs, kws, nw = p_in
        if name == "fused":
            out, lse = attn_res_partial_train(b_in[:-1], qs, kws, 1e-6)
            x = attn_res_merge_norm_train(out[1], lse[1], b_in[-1], qs[1], kws[1], nw, 1e-6, 1e-6)
            extra = out[2].sum() + lse[3].sum()  # the other rows get gradients too
        else:
            parts = [naive_attn_res_partial(b_in[:-1], qs[i], kws[i], 1e-6) for i in range(Q)]
            x = rms_norm(naive_attn_res_merge(*parts[1], b_in[-1], qs[1], kws[1], 1e-6), nw, 1e-6)
            extra = parts[2][0].sum() + parts[3][1].sum()
        loss = (x.double() * cot.double()).sum() + extra.double() * 1e-3
        results[name] = (x.detach(), torch.autograd.grad(loss, b_in + p_in))
        del x, b_in, p_in, loss
    (fo, fg), (po, pg), (ro, rg) = results["fused"], results["plain"], results["ref"]
    assert_as_accurate(f"block N={N} out", fo, ro, po, floor=2**-8)
    labels = [f"block {i}" for i in range(N)] + ["partial", "queries", "key_weights", "norm_weight"]
    for label, f, p, r in zip(labels, fg, pg, rg, strict=True):
        assert_as_accurate(f"block N={N} d {label}", f, r, p, floor=2**-8)


def _chain(src, params, ref: bool):
    """Steps l = 2 .. S of a Full AttnRes stream over `src` (step l reads src[:l]); -> every step's output. `ref`:
    the PyTorch composition (each step its own graph node, autograd sums the gradients)."""
    from hybrid_attention.ops.attnres.full_stream import attn_res_norm_step, attn_res_norm_stream_start
    from hybrid_attention.ops.attnres.naive import naive_attn_res
    from hybrid_attention.ops.numerics import rms_norm

    if ref:
        return [
            rms_norm(naive_attn_res(src[:l], q, kw, 1e-6), nw, 1e-6)
            for (q, kw, nw), l in zip(params, range(2, len(src) + 1), strict=True)
        ]
    queries, key_weights, norm_weights = (torch.stack([p[i] for p in params]) for i in range(3))
    x, carrier = attn_res_norm_stream_start(src[:2], queries, key_weights, norm_weights, 1e-6, 1e-6)
    outs = [x]
    for l in range(3, len(src) + 1):
        x, carrier = attn_res_norm_step(src[:l], carrier, 1e-6)
        outs.append(x)
    return outs


def _stream_params(S, D, g):
    return [
        [
            torch.randn(D, device="cuda", generator=g) * 2 * D**-0.5,
            *(0.5 + torch.rand(2, D, device="cuda", generator=g)),
        ]
        for _ in range(2, S + 1)
    ]


def _stream_results(src, params, cots):
    """[(outputs, gradients of the sources and every step's parameters)] of the fused stream, the plain composition
    at the sources' precision and the float64 composition, for the cotangents `cots` of the outputs."""
    results = []
    for name, dtype in (("fused", None), ("plain", None), ("ref", torch.float64)):
        s_in = _leaves([s if dtype is None else s.to(dtype) for s in src])
        p_in = [_leaves([p if dtype is None else p.to(dtype) for p in ps]) for ps in params]
        outs = _chain(s_in, p_in, ref=name != "fused")
        flat = [p for ps in p_in for p in ps]
        loss = sum((o.double() * c.double()).sum() for o, c in zip(outs, cots, strict=True))
        results.append(([o.detach() for o in outs], torch.autograd.grad(loss, s_in + flat)))
        del outs, s_in, p_in, loss
    return results


STREAM_CONFIGS = [
    *[("_full_fwd_kernel", i) for i in range(len(FULL_FWD_CONFIGS))],
    *[("_stream_local_kernel", i) for i in range(len(STREAM_LOCAL_CONFIGS))],
    *[("_stream_bwd_kernel", i) for i in range(len(STREAM_BWD_CONFIGS))],
]


@pytest.mark.parametrize("config", [None, *STREAM_CONFIGS], ids=lambda v: "tuned" if v is None else f"{v[0]}-{v[1]}")
def test_fused_training_stream_at_model_sizes(config, monkeypatch):
    """A Full AttnRes stream of 27 sources (the k3-scaled depth), whose backwards assemble each source's gradient
    once, at T=2048, D=1024, bf16 sources: every output and every gradient as accurate against float64 as the bf16
    PyTorch composition; with the tuned launch shapes and with each forward and backward config alone."""
    if config is not None:
        only_config(monkeypatch, config)
    S, B, T, D = 27, 1, 2048, 1024
    g = torch.Generator("cuda").manual_seed(27)
    src = _sources(S, B, T, D, g)
    params = _stream_params(S, D, g)
    cots = [torch.randn(B, T, D, device="cuda", generator=g) for _ in range(2, S + 1)]
    (fo, fg), (po, pg), (ro, rg) = _stream_results(src, params, cots)
    for l, f, p, r in zip(range(2, S + 1), fo, po, ro, strict=True):
        assert_as_accurate(f"stream step {l} out", f, r, p, floor=2**-8)
    labels = [f"source {i}" for i in range(S)] + [f"step {l} {n}" for l in range(2, S + 1) for n in "wgn"]
    for label, f, p, r in zip(labels, fg, pg, rg, strict=True):
        assert_as_accurate(f"stream d {label}", f, r, p, floor=2**-8)


def test_stream_gradients_repeat_bitwise():
    """Two backwards of the same 27-source stream at B=8, T=2048, D=1024 (bf16) give bitwise equal gradients: no
    atomics, fixed summation orders (the second run uses the tuned configs the first one chose)."""
    S, B, T, D = 27, 8, 2048, 1024
    g = torch.Generator("cuda").manual_seed(28)
    src = _leaves(_sources(S, B, T, D, g))
    params = [_leaves(ps) for ps in _stream_params(S, D, g)]
    inputs = src + [p for ps in params for p in ps]
    runs = []
    for _ in range(3):  # the first one tunes
        outs = _chain(src, params, ref=False)
        loss = sum((o.float() * (i + 1)).square().mean() for i, o in enumerate(outs))
        runs.append(torch.autograd.grad(loss, inputs))
        del outs, loss
    for i, (a, b) in enumerate(zip(runs[1], runs[2], strict=True)):
        assert torch.equal(a, b), f"gradient of input {i} differs between two runs"


def test_stream_finds_its_pointer_tables_again():
    """Training repeats the same allocations every step, so a repeated step of a Full AttnRes stream finds every
    pointer table it needs already built (no host-to-device copy per kernel launch)."""
    from hybrid_attention.ops.attnres import rows
    from hybrid_attention.ops.attnres.full_stream import attn_res_norm_step, attn_res_norm_stream_start

    S, B, T, D = 9, 2, 512, 1024
    g = torch.Generator("cuda").manual_seed(9)
    params = [
        [torch.randn(D, device="cuda", generator=g), *(0.5 + torch.rand(2, D, device="cuda", generator=g))]
        for _ in range(2, S + 1)
    ]
    weights = [torch.randn(D, device="cuda", generator=g).requires_grad_() for _ in range(2, S + 1)]

    queries, key_weights, norm_weights = (torch.stack([p[i] for p in params]) for i in range(3))

    def step():
        src = [torch.randn(B, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()]
        carrier = None
        for w in weights:
            src.append((src[-1] * w).bfloat16())  # a new tensor every step, as a sublayer output is
            if carrier is None:
                x, carrier = attn_res_norm_stream_start(src, queries, key_weights, norm_weights)
            else:
                x, carrier = attn_res_norm_step(src, carrier)
        x.float().square().sum().backward()

    step()
    step()  # the first steps allocate the weights' gradients; from here on every step allocates alike
    known = set(rows._tables)
    step()
    torch.cuda.synchronize()
    built = len(set(rows._tables) - known)
    assert built == 0, f"{built} pointer tables built again on a repeated step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, step", [(1, 0), (1, 25), (2, 0)])
def test_dzr_products_at_model_sizes(dtype, n, step):
    """The stream's dL/du product (tensor cores for half sources, a full float32 product otherwise) at B=8, T=2048,
    D=1024, K=27: the sum of its partial sums as accurate against a float64 product as cuBLAS's float32-accumulated
    product of the same inputs."""
    from hybrid_attention.ops.attnres.triton_stream_bwd import add_dzr_products_, param_table_rows

    M, D, K = 8 * 2048, 1024, 27
    g = torch.Generator("cuda").manual_seed(n + step)
    srcs = [torch.randn(M, D, device="cuda", generator=g).to(dtype) for _ in range(n)]
    half = dtype != torch.float32
    dzr = torch.randn(n, 2 if half else 1, K - step, M, device="cuda", generator=g).to(dtype)
    splits, _ = param_table_rows(M, srcs[0].device)
    part = torch.randn(splits, K, D, device="cuda", generator=g)
    want, plain = part.double().sum(0), part.sum(0)
    for j, v in enumerate(srcs):
        want[step:] += dzr[j].double().sum(0) @ v.double()
        product = torch.mm(dzr[j].view(-1, M), v, out_dtype=torch.float32) if half else dzr[j].view(-1, M) @ v
        plain[step:] += product.view(-1, K - step, D).sum(0)
    add_dzr_products_(srcs, dzr, part, step)
    assert_as_accurate(f"dz r products {dtype} n={n} step={step}", part.sum(0), want, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stream_gradients_with_a_shared_direction(dtype):
    """A Full AttnRes stream of 27 sources at D=1024 whose sources share a direction (cosines around 0.5), so the
    backward's dz_i = p_i (dh . v_i - dh . h) cancels: every gradient as accurate against float64 as the PyTorch
    composition at the same precision, down to 2^-12 (the forward keeps h's rounding residual for dh . h; with the
    rounded h the parameters' gradients are several times less accurate, which the 2^-8 floor above lets pass)."""
    S, B, T, D = 27, 1, 512, 1024
    g = torch.Generator("cuda").manual_seed(31)
    shared = torch.randn(B, T, D, device="cuda", generator=g)
    src = [(shared + torch.randn(B, T, D, device="cuda", generator=g)).to(dtype) for _ in range(S)]
    params = _stream_params(S, D, g)
    cots = [torch.randn(B, T, D, device="cuda", generator=g) for _ in range(2, S + 1)]
    (_, fg), (_, pg), (_, rg) = _stream_results(src, params, cots)
    labels = [f"source {i}" for i in range(S)] + [f"step {l} {n}" for l in range(2, S + 1) for n in "wgn"]
    for label, f, p, r in zip(labels, fg, pg, rg, strict=True):
        assert_as_accurate(f"shared-direction stream {dtype} d {label}", f, r, p, floor=2**-12)
