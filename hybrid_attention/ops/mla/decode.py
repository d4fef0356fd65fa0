"""Absorbed MLA decode over the latent cache, `mla_decode`: the public entry point, its input checks and length
conventions, and a PyTorch path (docs/kernels.md, "MLA decode kernels").
"""

from __future__ import annotations

import torch

from hybrid_attention.ops.backends import check_backend, needs_grad, resolve
from hybrid_attention.ops.mla.naive import naive_absorbed_attention
from hybrid_attention.ops.triton_support import TRITON_DTYPES, triton_available, triton_runs_on


def _check_inputs(
    q: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, value_dim: int, scale: float, num_splits: int | None
) -> None:
    """Raise ValueError naming what is wrong with the arguments of `mla_decode` (never syncs with a GPU)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"mla_decode: q must be [B, Tq, H, D], got shape {tuple(getattr(q, 'shape', ()))}")
    if not isinstance(rows, torch.Tensor) or rows.dim() != 3:
        raise ValueError(f"mla_decode: rows must be [B, max_len, D], got shape {tuple(getattr(rows, 'shape', ()))}")
    B, Tq, H, D = q.shape
    if rows.shape[0] != B or rows.shape[2] != D:
        raise ValueError(
            f"mla_decode: rows shape {tuple(rows.shape)} does not match q shape {tuple(q.shape)}; "
            f"expected [B={B}, max_len, D={D}]"
        )
    if min(B, Tq, H, D) < 1:
        raise ValueError(f"mla_decode: q shape {tuple(q.shape)} has an empty dimension")
    if rows.shape[1] < Tq:
        raise ValueError(f"mla_decode: cache length max_len={rows.shape[1]} is shorter than Tq={Tq} query tokens")
    if not q.is_floating_point() or q.dtype != rows.dtype:
        raise ValueError(f"mla_decode: q and rows must share one floating dtype, got {q.dtype} and {rows.dtype}")
    if rows.stride(-1) != 1:
        raise ValueError(f"mla_decode: rows must have unit stride in its last dim, got strides {rows.stride()}")
    if isinstance(value_dim, bool) or not isinstance(value_dim, int) or not 1 <= value_dim <= D:
        raise ValueError(f"mla_decode: value_dim must be an int in [1, D={D}], got {value_dim!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 < float(scale) < float("inf"):
        raise ValueError(f"mla_decode: scale must be a positive finite number, got {scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"mla_decode: num_splits must be None or an int >= 1, got {num_splits!r}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"mla_decode: seq_lens must be an int32 tensor of shape [B={B}], got "
            f"{getattr(seq_lens, 'dtype', type(seq_lens))} of shape {tuple(getattr(seq_lens, 'shape', ()))}"
        )
    if q.device != rows.device or seq_lens.device != q.device:
        raise ValueError(
            f"mla_decode: q, rows and seq_lens must be on one device, got {q.device}, {rows.device}, {seq_lens.device}"
        )
    if seq_lens.device.type == "cpu":  # free to check here; on a GPU it would need a host sync
        bad = (seq_lens < Tq) | (seq_lens > rows.shape[1])
        if bool(bad.any()):
            raise ValueError(
                f"mla_decode: seq_lens must lie in [Tq={Tq}, max_len={rows.shape[1]}], got {seq_lens.tolist()}"
            )


def decode_backend(backend: str, q: torch.Tensor, rows: torch.Tensor, name: str) -> str:
    """The backend a decode over latent rows (contiguous or paged) runs, "torch" or "triton": `backend` resolved by
    the rule of `ops.backends`; raises ValueError, naming `name`, when "triton" is asked for where it cannot run."""
    # The kernel has no backward pass; "auto" keeps autograd working by taking the PyTorch path instead.
    grad = needs_grad(q, rows)
    backend = resolve(backend, q, name=name, needs_backward=grad)
    if backend == "torch":
        return backend
    if grad:
        raise ValueError(
            f"{name}: backend='triton' is inference-only (no backward); call it under torch.no_grad() "
            "or use backend='torch' when gradients are needed"
        )
    if not triton_runs_on(q):
        raise ValueError(
            f"{name}: backend='triton' needs the triton package, a CUDA tensor (or TRITON_INTERPRET=1 on CPU) "
            f"and dtype in {TRITON_DTYPES}; got device {q.device}, dtype {q.dtype}, triton "
            f"{'installed' if triton_available() else 'missing'}"
        )
    return backend


def naive_mla_decode(
    q: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Masked softmax attention over the latent cache in PyTorch (fp32 math, fp64 for fp64 inputs).

    Same signature and result as `mla_decode`; `num_splits` is accepted for parity and has no effect.
    q [B, Tq, H, D], rows [B, max_len, D], seq_lens int32 [B] -> [B, Tq, H, value_dim] in q.dtype.
    """
    _check_inputs(q, rows, seq_lens, value_dim, scale, num_splits)
    return naive_absorbed_attention(q, rows, value_dim=value_dim, scale=scale, causal=True, seq_lens=seq_lens)


def mla_decode(
    q: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    num_splits: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode Tq query tokens per sequence against the latent MLA cache (absorbed form, MQA with one KV head).

    Args:
        q: [B, Tq, H, D] absorbed queries, D = d_c + d_s (Tq small: 1 for plain decode, a few for MTP/chunk tails).
        rows: [B, max_len, D] cache rows [c ; k_s]; only the first seq_lens[b] rows of sequence b are read.
        seq_lens: int32 [B] on q's device, each in [Tq, max_len] (checked only for CPU tensors, see module doc).
        value_dim: values are rows[..., :value_dim] (d_c); 1 <= value_dim <= D.
        scale: softmax scale, passed explicitly: (d_n + d_s) ** -0.5 for Gated MLA, not D ** -0.5.
        num_splits: context splits per sequence for the Triton kernel (None: chosen from B, max_len, SM count).
        backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1; inference only, no backward), "torch"
            (differentiable), or "auto" (Triton on CUDA when no gradient is needed, else PyTorch; see
            `hybrid_attention.ops.backends`).

    Returns:
        [B, Tq, H, value_dim] in q.dtype; query i of sequence b attends softmax-weighted over keys
        j <= seq_lens[b] - Tq + i, with fp32 accumulation.
    """
    check_backend(backend, "mla_decode")
    _check_inputs(q, rows, seq_lens, value_dim, scale, num_splits)
    if decode_backend(backend, q, rows, "mla_decode") == "torch":
        return naive_absorbed_attention(q, rows, value_dim=value_dim, scale=scale, causal=True, seq_lens=seq_lens)
    from hybrid_attention.ops.mla.triton_decode import mla_decode_triton

    return mla_decode_triton(q, rows, seq_lens, value_dim=value_dim, scale=scale, num_splits=num_splits)
