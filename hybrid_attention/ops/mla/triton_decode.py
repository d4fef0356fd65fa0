"""Flash decoding for absorbed MLA over the latent cache: `mla_decode_triton` plans the split count and block sizes and
launches kernels/split.py and kernels/merge.py (docs/kernels.md, "MLA decode kernels").
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from hybrid_attention.ops.mla.kernels.merge import _merge_kernel
from hybrid_attention.ops.mla.kernels.split import _split_kernel
from hybrid_attention.ops.triton_support import sm_count

# Rows a split should stream at least, so that its start-up and (m, l, acc) write-back stay small next to its reads;
# small enough that batch-1 decoding at a few thousand tokens still spreads over dozens of SMs.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 512
RESIDENT_PER_SM = 2  # programs an SM holds at once with the default config (~85 KB shared memory each on sm_90)
MERGE_BLOCK_S = 32
MERGE_BLOCK_D = 64


def default_num_splits(programs_per_split: int, max_len: int, num_sms: int) -> int:
    """Splits per sequence so that `programs_per_split * num_splits` fills one wave of resident programs.

    `programs_per_split` is B times the number of query-row blocks. One full wave (rounded down, never up: a second,
    nearly empty wave would cost a whole program's time) streams the cache with every SM busy. Each split keeps at
    least MIN_SPLIT_TOKENS rows of a full-length context. Depends only on shapes (never on seq_lens): graph safe.
    """
    want = (RESIDENT_PER_SM * num_sms) // programs_per_split
    useful = triton.cdiv(max_len, MIN_SPLIT_TOKENS)
    return max(1, min(want, useful, MAX_SPLITS))


def _config(block_dv: int, block_dt: int, has_tail: bool, elem_bytes: int, block_m: int):
    """(block_n, num_warps, num_stages): about 36 KB of cache rows per pipeline stage, at most ~110 KB in flight."""
    row_bytes = (block_dv + (block_dt if has_tail else 0)) * elem_bytes
    block_n = 64
    while block_n > 16 and block_n * row_bytes > 40 * 1024:
        block_n //= 2
    num_stages = 3 if 3 * block_n * row_bytes <= 110 * 1024 else 2
    num_warps = 4 if block_m <= 32 else 8
    return block_n, num_warps, num_stages


def launch_plan(
    q: torch.Tensor,
    rows: torch.Tensor,
    *,
    value_dim: int,
    max_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> dict:
    """Block sizes, split count and launch options for q [B, Tq, H, D] over rows [B, max_len, D].

    Depends on shapes, dtype and the device only (never on seq_lens values). None means the tuned default;
    `max_len` defaults to rows.shape[1] (a paged cache passes its table's reach).
    """
    B, Tq, H, D = q.shape
    max_len = max_len or rows.shape[1]
    n_rows = Tq * H
    block_m = max(16, min(64, triton.next_power_of_2(n_rows)))
    m_blocks = triton.cdiv(n_rows, block_m)
    has_tail = D > value_dim
    block_dv = max(16, triton.next_power_of_2(value_dim))
    block_dt = max(16, triton.next_power_of_2(D - value_dim)) if has_tail else 16
    d_block_n, d_warps, d_stages = _config(block_dv, block_dt, has_tail, q.element_size(), block_m)
    block_n = block_n or d_block_n
    if num_splits is None:
        if q.device.type == "cuda":
            num_sms = sm_count(q.device)
        else:
            num_sms = 4  # the interpreter: a few splits, so CPU runs stay quick
        num_splits = default_num_splits(B * m_blocks, max_len, num_sms)
    return dict(
        max_len=max_len,
        n_rows=n_rows,
        block_m=block_m,
        m_blocks=m_blocks,
        has_tail=has_tail,
        block_dv=block_dv,
        block_dt=block_dt,
        block_n=block_n,
        num_warps=num_warps or d_warps,
        num_stages=num_stages or d_stages,
        # More splits than key blocks in the whole cache could only ever be empty.
        num_splits=max(1, min(num_splits, triton.cdiv(max_len, block_n))),
    )


def mla_decode_triton(
    q: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the decode kernels. Inputs are assumed checked by `hybrid_attention.ops.mla.decode.mla_decode` (or
    `ops.mla.paged.paged_mla_decode`).

    q [B, Tq, H, D], rows [B, max_len, D] (last-dim stride 1), seq_lens int32 [B] -> [B, Tq, H, value_dim] in
    q.dtype. With `page_table` (int32 [B, pages], unit last stride) rows is a page pool [P, page_size, D] read
    through it. `block_n`, `num_warps` and `num_stages` override the tuned defaults (for benchmarks).
    """
    B, Tq, H, _ = q.shape
    if rows.stride(-1) != 1:
        raise ValueError(f"mla_decode_triton: rows must have unit stride in its last dim, got {rows.stride()}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    page = 0 if page_table is None else rows.shape[1]
    plan = launch_plan(
        q,
        rows,
        value_dim=value_dim,
        max_len=None if page_table is None else page_table.shape[1] * page,
        num_splits=num_splits,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    plan.update(page=page, table=page_table)
    n_rows, num_splits = plan["n_rows"], plan["num_splits"]
    out = torch.empty(B, Tq, H, value_dim, device=q.device, dtype=q.dtype)
    single = num_splits == 1
    if single:
        m_part = l_part = acc_part = out  # unused by the SINGLE kernel
    else:
        m_part = torch.empty(B, n_rows, num_splits, device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B, n_rows, num_splits, value_dim, device=q.device, dtype=torch.float32)

    # Triton launches on the current device: make it q's (a no-op in the usual single-GPU case).
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _launch(q, rows, seq_lens, out, m_part, l_part, acc_part, plan, value_dim, scale)
    return out


def _launch(q, rows, seq_lens, out, m_part, l_part, acc_part, plan, value_dim, scale):
    B, Tq, H, D = q.shape
    n_rows, num_splits = plan["n_rows"], plan["num_splits"]
    single = num_splits == 1
    table = plan["table"] if plan["table"] is not None else seq_lens  # a placeholder the kernel never reads
    _split_kernel[(B, num_splits, plan["m_blocks"])](
        q,
        rows,
        seq_lens,
        table,
        out,
        m_part,
        l_part,
        acc_part,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        rows.stride(0),
        rows.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        plan["max_len"],
        num_splits,
        float(scale) * math.log2(math.e),
        TQ=Tq,
        H=H,
        D=D,
        DV=value_dim,
        HAS_TAIL=plan["has_tail"],
        SINGLE=single,
        IEEE=q.dtype == torch.float32,
        BLOCK_M=plan["block_m"],
        BLOCK_N=plan["block_n"],
        BLOCK_DV=plan["block_dv"],
        BLOCK_DT=plan["block_dt"],
        PAGE=plan["page"],
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )
    if not single:
        block_d = min(MERGE_BLOCK_D, plan["block_dv"])
        _merge_kernel[(B, n_rows, triton.cdiv(value_dim, block_d))](
            m_part,
            l_part,
            acc_part,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            num_splits,
            TQ=Tq,
            H=H,
            DV=value_dim,
            BLOCK_S=MERGE_BLOCK_S,
            BLOCK_D=block_d,
            num_warps=4,
        )
