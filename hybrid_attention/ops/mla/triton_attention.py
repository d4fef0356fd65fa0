"""Launcher of the Triton flash attention with log-sum-exp (kernels/attention_lse.py): `kernel="triton"` of
`lse_attention.attention_with_lse`, the in-repo alternative to torch's SDPA kernels (inference only, no backward)."""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from hybrid_attention.ops.mla.kernels.attention_lse import _attention_lse_kernel


def attention_lse_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, DV] (causal: Tq == Tk; inputs checked by the caller) ->
    o [B, H, Tq, DV] in q.dtype (a view of a [B, Tq, H, DV] tensor, as SDPA's kernels return it), lse [B, H, Tq]
    float32."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3]
    o = torch.empty(B, Tq, H, DV, device=q.device, dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]), B * H)  # noqa: E731
    # Triton launches on the current device: make it q's (a no-op in the usual single-GPU case).
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _attention_lse_kernel[grid](
            q,
            k,
            v,
            o,
            lse,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *o.stride()[:3],
            H,
            Tq,
            Tk,
            float(scale) * math.log2(math.e),
            D=D,
            DV=DV,
            BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_DV=max(16, triton.next_power_of_2(DV)),
            CAUSAL=causal,
            IEEE=q.dtype == torch.float32,
        )
    return o, lse
