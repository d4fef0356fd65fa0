"""Small-batch matrix-vector products for decoding, y = x W^T (+ b) for a few rows of x, in one Triton kernel that
streams the weights (docs/kernels.md, "The decode GEMV").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.triton_support import as_rows, autotune, interpreting, triton_runs_on

MAX_ROWS = 64  # beyond this cuBLAS' tiled GEMM is the right tool


@autotune(
    [{"BN": 16, "BK": 256}, {"BN": 32, "BK": 128}, {"BN": 64, "BK": 128}], [(4, 3), (4, 4), (4, 3)], ["N", "K", "BM"]
)
@triton.jit
def _gemv_kernel(
    x,
    w,
    b,
    y,  # x [M, K] (row stride stride_x), w [N, K] (row stride stride_w), b [N], y [M, N] contiguous
    M,
    N,
    K,
    stride_x,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    EMU: tl.constexpr,
):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = (rk < K)[None, :]
        xt = tl.load(x + rm[:, None] * stride_x + rk[None, :], mask=(rm < M)[:, None] & k_ok, other=0.0)
        wt = tl.load(w + rn.to(tl.int64)[:, None] * stride_w + rk[None, :], mask=(rn < N)[:, None] & k_ok, other=0.0)
        if EMU:  # the interpreter mis-multiplies bfloat16 dots: float32 dots of the same values
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt), input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * N + rn[None, :], acc.to(y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel takes these: Triton runs here, same dtype, at most MAX_ROWS rows, unit stride along K."""
    rows = x.numel() // max(1, x.shape[-1])
    return triton_runs_on(x) and x.dtype == weight.dtype and rows <= MAX_ROWS and weight.stride(-1) == 1


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows, weight [N, K], bias [N] or None -> [..., N] in x.dtype, float32
    accumulation (what `F.linear` computes; no autograd)."""
    K, N = x.shape[-1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K or (bias is not None and tuple(bias.shape) != (N,)):
        raise ValueError(
            f"gemv: expected weight [N, {K}] and bias [N], got weight {tuple(weight.shape)}, "
            f"bias {None if bias is None else tuple(bias.shape)}"
        )
    if not gemv_applies(x, weight):
        raise ValueError(
            f"gemv: needs Triton for {x.dtype} on {x.device}, x and weight of one dtype (got {weight.dtype}), at most "
            f"{MAX_ROWS} rows (got {x.numel() // max(1, K)}) and a weight with unit stride along K"
        )
    x2 = as_rows(x, K)
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M > 0 and N > 0:
        grid = lambda meta: (triton.cdiv(N, meta["BN"]),)  # noqa: E731
        _gemv_kernel[grid](
            x2,
            weight,
            bias if bias is not None else weight,
            y,
            M,
            N,
            K,
            x2.stride(0),
            weight.stride(0),
            HAS_BIAS=bias is not None,
            BM=max(16, triton.next_power_of_2(M)),
            PREC="ieee" if x.dtype == torch.float32 else "tf32",
            EMU=interpreting() and x.dtype == torch.bfloat16,
        )
    return y.view(*x.shape[:-1], N)
