"""The Block AttnRes backward kernels (`ops.attnres.triton_block_partial`, `triton_block_merge`) under each of their
tuned configs alone, against the readable references in `ops.attnres.naive`: outputs and every gradient, in float64
under the interpreter.

Phase 1's backward holds all of a row's blocks in one tile up to PARTIAL_BWD_BLOCKS of them and reads more one
block row at a time (its second kernel); phase 2's backward takes BLOCK_M rows at a time. The rows here (37) leave a
partial last block of rows for every BLOCK_M, the block counts cover one block, a tile with unused rows, and more
blocks than a tile holds, with one and several queries, zero and non-zero.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.ops.attnres import triton_block_merge, triton_block_partial
from hybrid_attention.ops.attnres.block_stream import attn_res_merge_norm_train, attn_res_partial_train
from hybrid_attention.ops.attnres.naive import naive_attn_res_merge, naive_attn_res_partial
from hybrid_attention.ops.numerics import rms_norm
from hybrid_attention.ops.triton_support import interpreting
from tests.helpers import DEV, assert_close
from tests.ops.attnres.test_train import check_grads, f64, grads, sources

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
F64 = torch.float64 if DEV == "cpu" else torch.float32  # float64 runs only under the interpreter
TOL = 1e-12 if F64 == torch.float64 else 1e-4
ROWS, D = 37, 16  # odd: a partial last block of rows for every BLOCK_M
EPS, NORM_EPS = 1e-6, 1e-5
MANY_BLOCKS = triton_block_partial.PARTIAL_BWD_BLOCKS + 2  # past one tile: the row-at-a-time kernel


def distinct_configs(tuner):
    """The tuner's configs; under the interpreter, which ignores num_warps, one per tile shape."""
    if torch.cuda.is_available():
        return tuner.all_configs
    shapes = {}
    for config in tuner.all_configs:
        shapes.setdefault(tuple(sorted(config.kwargs.items())), config)
    return list(shapes.values())


PARTIAL_CONFIGS = distinct_configs(triton_block_partial._partial_bwd_kernel)
MERGE_CONFIGS = distinct_configs(triton_block_merge._merge_norm_bwd_kernel)


def only(monkeypatch, tuner, config):
    monkeypatch.setattr(tuner, "configs", [config])


def parameters(n, seed, *, rows=None, zero_query=False):
    """(query, key_weight, ...) leaves, [D] or [rows, D]: a random (or zero) query, then weights around one."""
    g = torch.Generator().manual_seed(seed)
    shape = (D,) if rows is None else (rows, D)
    query = torch.zeros(shape, dtype=torch.float64) if zero_query else torch.randn(shape, generator=g).double()
    rest = [0.5 + torch.rand(shape, generator=g, dtype=torch.float64) for _ in range(n - 1)]
    return [t.to(DEV, F64).requires_grad_() for t in (query, *rest)]


def config_id(config):
    return "-".join([*(f"{k}={v}" for k, v in config.kwargs.items()), f"warps={config.num_warps}"])


PARTIAL_CASES = [(1, 3, False), (3, 1, False), (3, 3, True), (MANY_BLOCKS, 3, False), (MANY_BLOCKS, 1, True)]


@pytest.mark.parametrize("config", PARTIAL_CONFIGS, ids=config_id)
@pytest.mark.parametrize("N, Q, zero_query", PARTIAL_CASES)
def test_partial_backward_every_config(config, N, Q, zero_query, monkeypatch, poisoned):
    """Phase 1 over N blocks for Q queries: the outputs, lse and every gradient (blocks, queries, key-norm weights)
    against the reference, with the phase-1 backward's config alone."""
    only(monkeypatch, triton_block_partial._partial_bwd_kernel, config)
    blocks = sources(N, D, seed=N + 10 * Q, shape=(ROWS,))
    queries, key_ws = parameters(2, seed=N + Q, rows=Q, zero_query=zero_query)
    out, lse = attn_res_partial_train(blocks, queries, key_ws, EPS)
    blocks64, (queries64, key_ws64) = f64(blocks), f64([queries, key_ws])
    ref = [naive_attn_res_partial(blocks64, queries64[q], key_ws64[q], EPS) for q in range(Q)]
    ref_out, ref_lse = [r[0] for r in ref], torch.stack([r[1] for r in ref])
    name = f"partial N={N} Q={Q} zero_query={zero_query} {config_id(config)}"
    assert_close(f"{name} out", torch.stack(out), torch.stack(ref_out), TOL)
    assert_close(f"{name} lse", lse, ref_lse, TOL)
    labels = [f"block {i}" for i in range(N)] + ["queries", "key_weights"]
    fused = grads((*out, lse), [*blocks, queries, key_ws])
    check_grads(name, fused, grads((*ref_out, ref_lse), [*blocks64, queries64, key_ws64]), labels)


@pytest.mark.parametrize("config", MERGE_CONFIGS, ids=config_id)
@pytest.mark.parametrize("with_partial, zero_query", [(True, False), (True, True), (False, False)])
def test_merge_backward_every_config(config, with_partial, zero_query, monkeypatch, poisoned):
    """Phase 2 + RMSNorm on a phase-1 result (so lse is consistent with out): the output and every gradient (out,
    lse, partial, query, key and norm weights) against the reference, with the phase-2 backward's config alone."""
    only(monkeypatch, triton_block_merge._merge_norm_bwd_kernel, config)
    blocks = sources(3, D, seed=3, shape=(ROWS,))
    (partial,) = sources(1, D, seed=4, shape=(ROWS,))
    query, key_w, norm_w = parameters(3, seed=5, zero_query=zero_query)
    with torch.no_grad():
        out0, lse0 = naive_attn_res_partial(blocks, query, key_w, EPS)
    out, lse = out0.clone().requires_grad_(), lse0.clone().requires_grad_()
    x = attn_res_merge_norm_train(out, lse, partial if with_partial else None, query, key_w, norm_w, EPS, NORM_EPS,
                                  dtype=F64)  # fmt: skip
    inputs = [out, lse, partial, query, key_w, norm_w]
    o64, l64, p64, q64, k64, n64 = inputs64 = f64(inputs)
    ref = rms_norm(naive_attn_res_merge(o64, l64, p64, q64, k64, EPS) if with_partial else o64, n64, NORM_EPS)
    name = f"merge partial={with_partial} zero_query={zero_query} {config_id(config)}"
    assert_close(name, x, ref, TOL)
    labels = ["out", "lse", "partial", "query", "key_weight", "norm_weight"]
    check_grads(name, grads((x,), inputs), grads((ref,), inputs64), labels)
