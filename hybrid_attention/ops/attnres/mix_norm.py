"""Fused inference AttnRes, `attn_res_norm`: the depth softmax over a preallocated sources buffer and the next
sublayer's RMSNorm in one kernel, no backward (docs/kernels.md, "Inference: `attn_res_norm`").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.attnres.naive import naive_attn_res
from hybrid_attention.ops.backends import check_backend, needs_grad, resolve
from hybrid_attention.ops.numerics import rms_norm
from hybrid_attention.ops.triton_support import TRITON_DTYPES, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path still works
    triton = None

MAX_TILE = 16384  # fp32 elements of one [BLOCK_S, BLOCK_D] tile: 64 registers per thread at 8 warps
MAX_ROW = 16384  # the widest D read in one pass (a whole row per source); wider rows go in D-chunks, three passes
FEW_ROWS = 256  # up to this many rows the kernel is latency-bound (decoding): read all sources at once


if triton is not None:

    @triton.jit
    def _attn_res_norm_kernel(
        src_ptr,  # [S, M, D] (row stride stride_m, source stride stride_s, unit stride in D)
        latest_ptr,  # [M, D] contiguous: source S - 1, stored into src slot S - 1 here (HAS_LATEST only)
        query_ptr,  # [D]
        key_w_ptr,  # [D]
        norm_w_ptr,  # [D] (unused without HAS_NORM)
        out_ptr,  # [M, D] contiguous
        S,
        D,
        stride_s,
        stride_m,
        eps,
        norm_eps,
        HAS_NORM: tl.constexpr,
        HAS_LATEST: tl.constexpr,
        ONE_PASS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # torch.compile (inductor) passes float scalars as fp64: left so, they would turn the float32 running max
        # of the depth softmax into fp64 inside its loop, which Triton rejects.
        eps = tl.cast(eps, tl.float32)
        norm_eps = tl.cast(norm_eps, tl.float32)
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        tile = src_ptr + row * stride_m + offs_s.to(tl.int64)[:, None] * stride_s + offs_d[None, :]
        slot = src_ptr + row * stride_m + (S - 1) * stride_s  # where the latest source is stored
        out_row = out_ptr + row * D

        if ONE_PASS:
            # Every row of D fits the tile: one read of the sources, BLOCK_S of them at a time, with an online
            # softmax over the depth (a running max and sum, the mixture rescaled as the max grows).
            d_ok = offs_d < D
            w = tl.load(query_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            w = w * tl.load(key_w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # gamma folded into w
            run_max = float("-inf")
            run_sum = 0.0
            acc = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, S, BLOCK_S):
                src_s = s0 + offs_s
                in_buffer = (src_s < S - 1) if HAS_LATEST else (src_s < S)
                v = tl.load(tile + s0 * stride_s, mask=in_buffer[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                if HAS_LATEST:  # noqa: SIM102 (a compile-time test, then a run-time one: kept apart for Triton)
                    if s0 + BLOCK_S >= S:  # the chunk holding source S - 1
                        lat = tl.load(latest_ptr + row * D + offs_d, mask=d_ok, other=0.0)
                        tl.store(slot + offs_d, lat, mask=d_ok)
                        v = tl.where((src_s == S - 1)[:, None], lat.to(tl.float32)[None, :], v)
                logits = tl.sum(v * w[None, :], axis=1) * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
                logits = tl.where(src_s < S, logits, float("-inf"))
                new_max = tl.maximum(run_max, tl.max(logits, axis=0))
                rescale = tl.exp(run_max - new_max)  # 0 on the first chunk (run_max = -inf)
                p = tl.exp(logits - new_max)
                run_sum = run_sum * rescale + tl.sum(p, axis=0)
                acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
                run_max = new_max
            h = (acc / run_sum).to(out_ptr.dtype.element_ty).to(tl.float32)
            if HAS_NORM:
                nw = tl.load(norm_w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + norm_eps) * nw
            tl.store(out_row + offs_d, h.to(out_ptr.dtype.element_ty), mask=d_ok)
        else:
            s_ok = offs_s < S
            is_latest = offs_s == S - 1
            from_buffer = (offs_s < S - 1) if HAS_LATEST else s_ok
            # Pass 1: per source, sum of squares and dot product with w * gamma.
            sq = tl.zeros([BLOCK_S], tl.float32)
            dot = tl.zeros([BLOCK_S], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d_ok = d0 + offs_d < D
                v = tl.load(tile + d0, mask=from_buffer[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                if HAS_LATEST:
                    lat = tl.load(latest_ptr + row * D + d0 + offs_d, mask=d_ok, other=0.0)
                    tl.store(slot + d0 + offs_d, lat, mask=d_ok)
                    v = tl.where(is_latest[:, None], lat.to(tl.float32)[None, :], v)
                w = tl.load(query_ptr + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                w = w * tl.load(key_w_ptr + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                sq += tl.sum(v * v, axis=1)
                dot += tl.sum(v * w[None, :], axis=1)
            logits = tl.where(s_ok, dot * tl.rsqrt(sq / D + eps), float("-inf"))
            p = tl.exp(logits - tl.max(logits, axis=0))
            p = p / tl.sum(p, axis=0)
            # Pass 2: the mixture chunk by chunk (written unnormalised) and the sum of squares of the rounded h.
            # It re-reads the latest source from its slot, written in pass 1 by this program: order the two.
            tl.debug_barrier()
            hh = tl.zeros([BLOCK_D], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d_ok = d0 + offs_d < D
                v = tl.load(tile + d0, mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                h = tl.sum(p[:, None] * v, axis=0).to(out_ptr.dtype.element_ty)
                tl.store(out_row + d0 + offs_d, h, mask=d_ok)
                hf = h.to(tl.float32)
                hh += hf * hf
            if HAS_NORM:
                # Pass 3: scale what pass 2 wrote (the barrier orders this program's own stores and loads).
                tl.debug_barrier()
                inv = tl.rsqrt(tl.sum(hh, axis=0) / D + norm_eps)
                for d0 in range(0, D, BLOCK_D):
                    d_ok = d0 + offs_d < D
                    h = tl.load(out_row + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                    nw = tl.load(norm_w_ptr + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                    tl.store(out_row + d0 + offs_d, (h * inv * nw).to(out_ptr.dtype.element_ty), mask=d_ok)


def _launch_shape(M: int, S: int, D: int, block_s=None, block_d=None) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_D, num_warps) for M rows of S sources of width D; block_s / block_d force a shape (tests).

    With few rows (decoding) each program waits on its loads, so it reads every source in one tile with 8 warps;
    with thousands of rows many programs keep the GPU busy and small tiles (4 sources of 1024, 4 warps) read
    faster (measurements in docs/performance.md)."""
    full_d = triton.next_power_of_2(D)
    all_s = triton.next_power_of_2(S)
    if block_d is None:
        block_d = full_d if full_d <= MAX_ROW else max(16, MAX_TILE // all_s)
    block_d = min(block_d, full_d)
    if block_d < D:  # D-chunked passes: every source in the tile
        return all_s, block_d, 8 if all_s * block_d >= 8192 else 4
    if block_s is None:
        budget = 2 * MAX_TILE if M <= FEW_ROWS else MAX_TILE // 4
        block_s = max(1, min(all_s, budget // full_d))
    return block_s, block_d, 8 if block_s * block_d >= 8192 and M <= FEW_ROWS else 4


def _check(sources, query, key_weight, norm_weight, latest) -> None:
    if not isinstance(sources, torch.Tensor) or sources.dim() < 2 or sources.shape[0] == 0:
        raise ValueError(
            f"attn_res_norm: sources must be a stacked tensor [S, ..., D] with S >= 1, got "
            f"{tuple(getattr(sources, 'shape', ()))}"
        )
    D = sources.shape[-1]
    for label, t in (("query", query), ("key_weight", key_weight), ("norm_weight", norm_weight)):
        if t is not None and tuple(t.shape) != (D,):
            raise ValueError(f"attn_res_norm: {label} must have shape [{D}], got {tuple(t.shape)}")
    if query is None or key_weight is None:
        raise ValueError("attn_res_norm: query and key_weight are required tensors [D]")
    if not sources.is_floating_point():
        raise ValueError(f"attn_res_norm: sources must be floating point, got {sources.dtype}")
    if latest is not None and (latest.shape != sources.shape[1:] or latest.dtype != sources.dtype):
        raise ValueError(
            f"attn_res_norm: latest must be {sources.dtype} {tuple(sources.shape[1:])} (one source slot), got "
            f"{latest.dtype} {tuple(latest.shape)}"
        )


def attn_res_norm(
    sources: torch.Tensor,
    query: torch.Tensor,
    key_weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    latest: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """AttnRes over stacked sources, then (with `norm_weight`) an RMSNorm, for inference.

    Args:
        sources: [S, B, T, D] (any [S, ..., D]; a view of the first S slots of a larger buffer is fine).
        latest: [B, T, D], the newest source: it is written into `sources[S - 1]` (which may hold anything before)
            and used as that source, in the same kernel (saves a copy per sublayer).
        query, key_weight: [D], the AttnRes pseudo-query and key-norm weight; eps is the key norm's epsilon.
        norm_weight: [D] weight of the RMSNorm applied to the mixture (None: return the mixture itself).
        norm_eps: that norm's epsilon.
        backend: "triton" (CUDA, or CPU with TRITON_INTERPRET=1; no autograd), "torch" (the reference
            composition, differentiable), "auto" (Triton on CUDA when no gradient is needed, else PyTorch; see
            `hybrid_attention.ops.backends`).

    Returns:
        [B, T, D] in sources.dtype: `rms_norm(naive_attn_res(sources, query, key_weight, eps), norm_weight, norm_eps)`,
        with norms, logits and softmax in float32 (float64 for float64 sources).
    """
    check_backend(backend, "attn_res_norm")
    _check(sources, query, key_weight, norm_weight, latest)
    grad = needs_grad(sources, query, key_weight, norm_weight, latest)
    backend = resolve(backend, sources, name="attn_res_norm", needs_backward=grad)
    if backend == "torch":
        if latest is not None:
            sources[-1] = latest
        h = naive_attn_res(sources, query, key_weight, eps)
        return h if norm_weight is None else rms_norm(h, norm_weight, norm_eps)
    if grad:
        raise ValueError("attn_res_norm: backend='triton' is inference-only; use backend='torch' for gradients")
    if not triton_runs_on(sources):
        raise ValueError(
            f"attn_res_norm: backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU) of dtype "
            f"in {TRITON_DTYPES}; got {sources.dtype} on {sources.device}"
        )
    return _attn_res_norm_triton(sources, query, key_weight, eps, norm_weight, norm_eps, latest=latest)


def _attn_res_norm_triton(
    sources, query, key_weight, eps, norm_weight, norm_eps, *, latest=None, block_s=None, block_d=None
):
    S, D = sources.shape[0], sources.shape[-1]
    out_shape = sources.shape[1:]
    # [S, M, D] without copying when the slots are row-contiguous (the preallocated buffer is).
    src = sources.reshape(S, -1, D)
    if src.stride(-1) != 1 or src.stride(1) != D:
        if latest is not None:  # the kernel writes into the buffer: a copy would silently drop that write
            raise ValueError("attn_res_norm: with `latest`, sources must be row-contiguous slots of one buffer")
        src = src.contiguous()
    M = src.shape[1]
    lat = None if latest is None else latest.reshape(M, D).contiguous()
    out = torch.empty(M, D, device=sources.device, dtype=sources.dtype)
    if M == 0:
        return out.view(out_shape)
    block_s, block_d, num_warps = _launch_shape(M, S, D, block_s, block_d)
    _attn_res_norm_kernel[(M,)](
        src,
        lat if lat is not None else src,
        query,
        key_weight,
        norm_weight if norm_weight is not None else query,
        out,
        S,
        D,
        src.stride(0),
        src.stride(1),
        float(eps),
        float(norm_eps),
        HAS_NORM=norm_weight is not None,
        HAS_LATEST=lat is not None,
        ONE_PASS=block_d >= D,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out.view(out_shape)
