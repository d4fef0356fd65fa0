"""Softmax attention that also returns each query row's log-sum-exp, through the fastest kernel that gives it:
partial attentions over disjoint key sets then merge exactly (docs/math.md, "Chunked prefill in the decompressed
form"). Kernels: cuDNN, FlashAttention-2 and memory-efficient attention (torch's SDPA backends, called directly for
their LSE), a Triton kernel of ours (by name), and a PyTorch math path for the CPU, float64 and autograd."""

from __future__ import annotations

import warnings

import torch

from hybrid_attention.ops.backends import fast_paths_enabled, needs_grad
from hybrid_attention.ops.numerics import HALF_DTYPES, compute_dtype
from hybrid_attention.ops.triton_support import TRITON_DTYPES, triton_runs_on

KERNELS = ("auto", "cudnn", "flash", "efficient", "triton", "math")

# Scores the math path holds at once (B * H * query block * keys): long rows go in query blocks.
MATH_SCORE_BUDGET = 1 << 24

# Query and key lengths cuDNN takes, and the most batch x heads it is given (see `pick_kernel`): a batch of 32
# sequences of 8 heads failed to execute on an H100, where one sequence runs at its best rate.
CUDNN_LENGTH_MULTIPLE = 1024
CUDNN_MAX_ROWS = 64

# Kernels that raised on this process's GPU: "auto" passes them over from then on (the failure is warned once).
_failed: set[str] = set()


def pick_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The kernel "auto" runs for q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv].

    On Hopper cuDNN, whose attention uses the card's asynchronous tensor-core instructions, while torch's flash backend
    is FlashAttention-2, written for Ampere, which leaves about a third of Hopper's rate unused. cuDNN builds an
    execution plan for each new shape (tens to hundreds of milliseconds), so it takes the lengths that are multiples
    of `CUDNN_LENGTH_MULTIPLE`, the few shapes a chunked prefill repeats, for up to `CUDNN_MAX_ROWS` sequences x
    heads; flash takes one-off lengths, large batches and Ampere.
    Both need one head dim <= 256 for q, k and v and a half dtype; otherwise the memory-efficient kernel (dims that
    are multiples of 8, float32 too), else the math path. torch's own switches count (`sdpa_kernel(...)`,
    `torch.backends.cuda.enable_cudnn_sdp(False)`), and so does `use_reference()`.
    """
    if not fast_paths_enabled() or needs_grad(q, k, v) or not q.is_cuda:
        return "math"  # the LSE of the fused kernels has no gradient, and a merge needs one
    dims = {q.shape[-1], k.shape[-1], v.shape[-1]}
    same_dim = len(dims) == 1 and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
    regular = q.shape[2] % CUDNN_LENGTH_MULTIPLE == 0 and k.shape[2] % CUDNN_LENGTH_MULTIPLE == 0
    major, _ = torch.cuda.get_device_capability(q.device)
    b = torch.backends.cuda
    few_rows = q.shape[0] * q.shape[1] <= CUDNN_MAX_ROWS
    if q.dtype in HALF_DTYPES and same_dim:
        if major >= 9 and regular and few_rows and b.cudnn_sdp_enabled() and "cudnn" not in _failed:
            return "cudnn"
        if major >= 8 and b.flash_sdp_enabled() and "flash" not in _failed:
            return "flash"
    efficient = q.dtype in TRITON_DTYPES and all(d % 8 == 0 for d in dims)  # fp16, bf16, fp32: not float64
    if efficient and b.mem_efficient_sdp_enabled() and "efficient" not in _failed:
        return "efficient"
    return "math"


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = False, kernel: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, Tq, D] over k [B, H, Tk, D], v [B, H, Tk, Dv] (any strides with a unit last
    one) -> (o [B, H, Tq, Dv] in q.dtype, lse [B, H, Tq] float32, float64 for float64 inputs).

    lse[b, h, i] = log sum_j exp(scale * q_i . k_j) over the keys row i sees. `causal` needs Tq == Tk (a chunk's
    own keys): query i sees keys j <= i. kernel: one of `KERNELS` ("auto": `pick_kernel`).
    """
    if kernel not in KERNELS:
        raise ValueError(f"attention_with_lse: kernel must be one of {KERNELS}, got {kernel!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"attention_with_lse: expected q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[2] == 0:
        raise ValueError(f"attention_with_lse: q and k need one head dim and k at least one key, got {tuple(k.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"attention_with_lse: causal needs Tq == Tk, got {q.shape[2]} and {k.shape[2]}")
    name = pick_kernel(q, k, v) if kernel == "auto" else kernel
    if name == "triton":
        return _triton(q, k, v, scale, causal)
    if name != "math" and not q.is_cuda:
        raise ValueError(f"attention_with_lse: kernel {name!r} runs on CUDA tensors, got {q.device}")
    if name == "math":
        return _math(q, k, v, scale, causal)
    try:
        return _FUSED[name](q, k, v, scale, causal)
    except RuntimeError as exc:
        if kernel != "auto":
            raise
        _failed.add(name)  # a shape or build this kernel does not take: the next one in `pick_kernel`'s order
        warnings.warn(f"attention_with_lse: the {name} kernel failed ({exc}); using another", RuntimeWarning, 2)
        return attention_with_lse(q, k, v, scale=scale, causal=causal, kernel="auto")


def _cudnn(q, k, v, scale, causal):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])  # cuDNN keeps the statistics as [B, H, Tq, 1]


def _flash(q, k, v, scale, causal):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _efficient(q, k, v, scale, causal):
    out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out[0], out[1][..., : q.shape[2]]  # the kernel pads the statistics' length to a multiple of 32


_FUSED = {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient}


def _triton(q, k, v, scale, causal):
    if needs_grad(q, k, v) or not triton_runs_on(q) or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(
            "attention_with_lse: kernel 'triton' needs triton, CUDA tensors (or TRITON_INTERPRET=1 on the CPU) of one "
            f"dtype in {TRITON_DTYPES} and no gradient; got {q.dtype} on {q.device}"
        )
    from hybrid_attention.ops.mla.triton_attention import attention_lse_triton

    return attention_lse_triton(q, k, v, scale, causal)


def _math(q, k, v, scale, causal):
    """Explicit scores, log-sum-exp and weights in float32 (float64 for float64), in query blocks of at most
    `MATH_SCORE_BUDGET` scores."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    dtype = compute_dtype(q)
    kt, vf = k.to(dtype).transpose(-1, -2), v.to(dtype)
    block = max(1, MATH_SCORE_BUDGET // (B * H * Tk))
    outs, lses = [], []
    for start in range(0, Tq, block):
        stop = min(Tq, start + block)
        scores = (q[:, :, start:stop].to(dtype) @ kt) * scale  # (B, H, block, Tk)
        if causal:
            rows = torch.arange(start, stop, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(Tk, device=q.device)[None, :] > rows, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (B, H, block)
        outs.append(torch.exp(scores - lse[..., None]) @ vf)
        lses.append(lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
