"""The residual streams on the fused AttnRes training ops (the interpreter on CPU, float64) against the readable list
path: Full AttnRes and Block AttnRes at block sizes that do and do not divide the sublayer count, outputs and every
gradient; one training step of the model (`HybridLM(..., attnres_backend="triton")`) with the same loss and parameter
gradients as `attnres_backend="torch"`; and `torch.compile` with fullgraph=True tracing a training step through the
custom ops."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.config import HybridConfig
from hybrid_attention.layers.attnres import AttnRes
from hybrid_attention.layers.norm import RMSNorm
from hybrid_attention.layers.stream import block_attn_res_stream, full_attn_res_stream
from hybrid_attention.model import HybridLM
from hybrid_attention.ops.attnres.naive import naive_attn_res
from hybrid_attention.ops.triton_support import interpreting
from tests.helpers import DEV, assert_close

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
DTYPE = torch.float64 if DEV == "cpu" else torch.float32
TOL = 1e-10 if DTYPE == torch.float64 else 1e-4


# Smaller than the tiny preset: the Triton interpreter runs every program of every kernel in Python.
SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, kda_head_dim=16, mla_kv_lora_rank=16,
    mla_qk_nope_head_dim=8, mla_qk_shared_head_dim=8, mla_v_head_dim=16,
)  # fmt: skip


def model_pair(residual, layer_types=("kda", "kda", "kda", "mla"), **overrides):
    """(fused, reference) small models with the same weights: random pseudo-queries, key-norm and norm weights."""
    torch.manual_seed(0)
    cfg = dict(SMALL, residual=residual, layer_types=layer_types, **overrides)
    config = HybridConfig.from_preset("tiny", **cfg)
    ref = HybridLM(config, kda_backend="torch", attnres_backend="torch").to(DEV, DTYPE)
    gen = torch.Generator().manual_seed(1)
    for name, p in ref.named_parameters():
        if name.endswith(".query"):
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        elif name.endswith("norm.weight"):
            p.data.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
    fused = HybridLM(config, kda_backend="torch", attnres_backend="triton").to(DEV, DTYPE)
    fused.load_state_dict(ref.state_dict())
    return fused, ref


def step_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def reference_stream(embedding, steps, block_size):
    """The list path, written out: sublayer i reads its AttnRes over the completed block sums and (unless it opens
    a block) the partial sum of its block; block_size None is Full AttnRes (every output is its own source)."""
    size = block_size or 1
    blocks, partial = [embedding], None
    for i, (res, norm, g) in enumerate(steps):
        if i % size == 0 and partial is not None and g is not None:
            blocks.append(partial)
            partial = None
        sources = blocks if partial is None else [*blocks, partial]
        h = sources[0] if res is None else naive_attn_res(sources, res.query, res.key_norm.weight, res.eps)
        x = norm(h)
        if g is None:
            return x
        y = g(x)
        partial = y if partial is None else partial + y


def make_steps(n, D, seed):
    """n sublayers g(x) = tanh(W x) with their AttnRes (random queries) and RMSNorms, then the final AttnRes; the
    first step reads the embedding alone and has no AttnRes."""
    torch.manual_seed(seed)
    steps, params = [], []
    for i in range(n + 1):
        res, norm = AttnRes(D, eps=1e-6), RMSNorm(D, eps=1e-5)
        res.query.data.normal_()
        res.key_norm.weight.data.uniform_(0.5, 1.5)
        norm.weight.data.uniform_(0.5, 1.5)
        lin = torch.nn.Linear(D, D, bias=False)
        g = None if i == n else (lambda x, lin=lin: torch.tanh(lin(x)))
        modules = [m.to(DEV, DTYPE) for m in (res, norm, lin)[: 2 if g is None else 3]]
        if i == 0:
            modules, res = modules[1:], None
        params += [p for m in modules for p in m.parameters()]
        steps.append((res, norm, g))
    return steps, params


@pytest.mark.parametrize(
    "n, block_size",
    [
        (5, None),  # Full AttnRes
        (0, None),  # the final norm alone, over the embedding (one source, no AttnRes)
        (1, None),  # a stream of one step: the final AttnRes
        (5, 1),  # Full AttnRes through the block path
        (5, 2),  # the last block is short
        (6, 2),  # the final AttnRes joins a full block
        (7, 3),
        (5, 8),  # one block larger than the depth
    ],
)
def test_stream_matches_reference(n, block_size):
    """The fused streams (layers.attnres) against the list path: output and the gradient of every input."""
    D = 16
    steps, params = make_steps(n, D, seed=n * 10 + (block_size or 0))
    emb = torch.randn(1, 3, D, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(DEV, DTYPE)
    emb.requires_grad_()
    if block_size is None:
        out = full_attn_res_stream(emb, steps)
    else:
        out = block_attn_res_stream(emb, steps, block_size)
    ref = reference_stream(emb, steps, block_size)
    assert_close("stream output", out, ref, TOL)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out)
    inputs = [emb, *params]
    fused_grads = torch.autograd.grad((out * cot).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * cot).sum(), inputs)
    for i, (a, b) in enumerate(zip(fused_grads, ref_grads, strict=True)):
        assert_close(f"stream d input {i}", a, b, TOL)


def test_full_stream_needs_one_key_norm_eps():
    """The Full AttnRes stream's backward recomputes each source's norm once for all its readers: one eps."""
    steps, _ = make_steps(3, 16, seed=4)
    steps[2][0].key_norm.eps = 1e-5
    emb = torch.randn(1, 3, 16, dtype=DTYPE, device=DEV)
    with pytest.raises(ValueError, match="share one key-norm eps"):
        full_attn_res_stream(emb, steps)


@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_training_step_matches_reference(residual):
    """One step of the model: the loss and every parameter's gradient (KDA and MLA sublayers, 3-sublayer blocks so
    the last one is short)."""
    fused, ref = model_pair(residual, ("kda", "mla"), attnres_block_size=3)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2)).to(DEV)
    loss, grads = step_grads(fused, ids)
    ref_loss, ref_grads = step_grads(ref, ids)
    assert_close("loss", loss, ref_loss, TOL)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g is not None and ref_grads[name] is not None, f"{name}: missing gradient"
        assert_close(f"d {name}", g, ref_grads[name], TOL)
    with torch.no_grad():  # no autograd: Block AttnRes stays on the fused ops, Full takes the inference path
        assert_close("no-grad logits", fused(ids).logits, ref(ids).logits, TOL)


def test_block_preset():
    cfg = HybridConfig.from_preset("k3-scaled-block")
    sublayers = 2 * cfg.num_layers
    blocks = -(-sublayers // cfg.attnres_block_size)
    assert cfg.residual == "block_attnres" and 6 <= blocks <= 9, (cfg.attnres_block_size, blocks)


def test_backend_errors():
    with pytest.raises(ValueError, match="attnres_backend"):
        HybridLM(HybridConfig.from_preset("tiny"), attnres_backend="cuda")


def test_compile_fullgraph_training_step():
    """A compiled training step (fullgraph: any graph break fails) gives the eager step's loss and gradients."""
    try:
        import torch._inductor  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"inductor unavailable: {e}")
    for residual in ("attnres", "block_attnres"):
        fused, _ = model_pair(residual, ("mla",), attnres_block_size=1)
        fused = fused.float() if DEV == "cuda" else fused
        ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(3)).to(DEV)
        loss, grads = step_grads(fused, ids)

        def step(ids, model=fused):
            return model(ids, labels=ids).loss

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")
        fused.zero_grad()
        closs = compiled(ids)
        closs.backward()
        assert_close(f"{residual} compiled loss", closs.detach(), loss, TOL)
        for name, p in fused.named_parameters():
            assert_close(f"{residual} compiled d {name}", p.grad, grads[name], TOL)
