"""Causal attention within each of several documents packed back to back (the MLA prefill of packed documents): torch's
varlen flash attention on CUDA, one SDPA call per document elsewhere (docs/training.md, "Packed documents").
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

MAX_FLASH_DIM = 256  # the flash kernels' largest head dimension


@functools.cache
def _torch_varlen():
    """torch's `varlen_attn` and its keyword names, or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def flash_supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's varlen flash attention takes these tensors (CUDA, half precision, head dims it tiles)."""
    dim = max(q.shape[-1], v.shape[-1])
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and dim <= MAX_FLASH_DIM
        and _torch_varlen() is not None
    )


def _flash(q, k, v, cu_seqlens, max_len, scale):
    """torch's varlen flash attention; q, k and v padded with zero columns to one head dimension (it takes one)."""
    varlen_attn, params = _torch_varlen()
    d_qk, d_v = q.shape[-1], v.shape[-1]
    dim = -(-max(d_qk, d_v) // 8) * 8
    if dim != d_qk:  # zero columns add nothing to q . k
        q, k = F.pad(q, (0, dim - d_qk)), F.pad(k, (0, dim - d_qk))
    if dim != d_v:
        v = F.pad(v, (0, dim - d_v))
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # causal, in each API
    if "scale" in params:
        kw["scale"] = scale
    else:  # torch 2.10 scales by dim ** -0.5
        q = q * (scale * dim**0.5)
    cu = cu_seqlens.to(torch.int32)
    o = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kw)
    return o[..., :d_v]


def causal_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, *, scale: float
) -> torch.Tensor:
    """q, k [T, H, D_qk], v [T, H, D_v], cu_seqlens int [N + 1] (on q's device; document n is tokens
    cu_seqlens[n] : cu_seqlens[n + 1]), max_len the longest document -> o [T, H, D_v], causal inside each document."""
    if flash_supported(q, v):
        return _flash(q, k, v, cu_seqlens, max_len, scale)
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            qd, kd, vd = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)
