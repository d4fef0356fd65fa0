"""The LM head and its cross-entropy in one op over token chunks, `linear_cross_entropy`: the [N, vocab] logits never
exist at once, and the backward recomputes each chunk's (docs/kernels.md, "The LM head and its cross-entropy").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.numerics import compute_dtype

# Logit elements per chunk: 2^24 keeps a chunk's float32 softmax at 64 MiB whatever the vocabulary (2048 tokens at a
# vocabulary of 8192): few chunks, so few launches, while the chunk's blocks (they sit on top of the step's peak,
# when every activation is kept) stay far below the whole logits.
CHUNK_ELEMENTS = 1 << 24


def _matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(h, weight) would run in: the autocast dtype when autocast is on for h's device."""
    device = h.device.type
    if torch.is_autocast_enabled(device) and h.is_floating_point():
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index: int, chunk: int, dtype: torch.dtype):
        h_dtype = h.dtype
        acc = compute_dtype(dtype)
        h = h.to(dtype)  # kept for the backward in the matmul dtype, as F.linear under autocast keeps its input
        w = weight.to(dtype)
        N = h.shape[0]
        valid = labels != ignore_index
        index = labels.clamp(min=0).unsqueeze(1)  # (N, 1); ignored rows read class 0 and are masked out below
        lse = torch.empty(N, device=h.device, dtype=acc)
        target = torch.empty(N, 1, device=h.device, dtype=acc)
        # Per chunk only what needs the chunk's logits (written into lse and target in place): few ops per chunk.
        for start in range(0, N, chunk):
            end = min(N, start + chunk)
            z = (h[start:end] @ w.t()).to(acc)  # (C, V)
            torch.logsumexp(z, dim=-1, out=lse[start:end])
            torch.gather(z, 1, index[start:end], out=target[start:end])
            del z  # freed before the next chunk's logits are made
        total = torch.where(valid, lse - target.squeeze(1), 0.0).sum()
        count = valid.sum()
        ctx.save_for_backward(h, weight, labels, lse, count)
        ctx.ignore_index, ctx.chunk, ctx.h_dtype = ignore_index, chunk, h_dtype
        # 0 / 0 = NaN when every label is ignored, as F.cross_entropy gives.
        return total / count

    @staticmethod
    def backward(ctx, grad):
        h, weight, labels, lse, count = ctx.saved_tensors
        dtype, chunk = h.dtype, ctx.chunk
        acc = lse.dtype
        w = weight.to(dtype)
        # No valid label: every row below is masked to zero, so any finite scale does.
        scale = grad.to(acc) / count.clamp(min=1)
        valid = (labels != ctx.ignore_index).to(acc).unsqueeze(1)  # (N, 1)
        index = labels.clamp(min=0).unsqueeze(1)
        minus_onehot, row_scale, lse = -valid, valid * scale, lse.unsqueeze(1)
        dh = torch.empty(h.shape, device=h.device, dtype=dtype) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if ctx.needs_input_grad[1] else None
        N = h.shape[0]
        for start in range(0, N, chunk):
            end = min(N, start + chunk)
            hc = h[start:end]
            # In place on the fresh (C, V) block: one float32 block per chunk, not one per elementwise op.
            p = (hc @ w.t()).to(acc).sub_(lse[start:end]).exp_()  # softmax
            p.scatter_add_(1, index[start:end], minus_onehot[start:end])  # - onehot(label)
            dz = p.mul_(row_scale[start:end]).to(dtype)
            if dh is not None:
                torch.mm(dz, w, out=dh[start:end])
            if dw is not None:
                dw += (dz.t() @ hc).to(acc)
            del p, dz  # freed before the next chunk's logits are made
        dh = None if dh is None else dh.to(ctx.h_dtype)
        dw = None if dw is None else dw.to(weight.dtype)
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight^T` against `labels`, without materialising the logits.

    Args:
        h: [N, D] hidden states (any float dtype; under autocast the matmuls run in the autocast dtype).
        weight: [V, D] the head's weight.
        labels: [N] integer class indices in [0, V), or `ignore_index` for tokens that do not count.
        ignore_index: label value left out of the mean (as in `F.cross_entropy`).
        chunk_size: tokens per chunk; None: as many as keep one chunk's logits at `CHUNK_ELEMENTS` elements.

    Returns:
        the scalar mean loss over the counted tokens, in float32 (float64 for float64 inputs); NaN when none counts,
        as `F.cross_entropy` gives (the gradients are then zero). Labels outside [0, V) other than `ignore_index`
        are not checked (a device-side index error on CUDA).
    """
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: h must be [N, D] and weight [V, D], got {tuple(h.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != h.shape[:1] or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"linear_cross_entropy: labels must be integer [N] = [{h.shape[0]}], got {labels.dtype} "
            f"{tuple(labels.shape)}"
        )
    if h.shape[0] == 0:
        raise ValueError("linear_cross_entropy: h has no rows (N = 0); expected at least one token")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // weight.shape[0])
    elif not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive int or None, got {chunk_size!r}")
    dtype = _matmul_dtype(h, weight)
    return _LinearCrossEntropy.apply(h, weight, labels.long(), ignore_index, min(chunk_size, h.shape[0]), dtype)
