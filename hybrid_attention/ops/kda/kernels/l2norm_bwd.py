"""KDA chunk backward, stage 4 (K > one K tile of stage 3): the backward of the fused q/k L2 norm, per row.

y = x * rstd, rstd = 1 / sqrt(|x|^2 + eps)  ->  dx = rstd * (dy - y (y . dy)). Rows of K: x [rows, K] (the input
dtype), rstd [rows] float32, dy [rows, K] float32 (dq, dk from stage 3); dx [rows, K] in x's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _l2norm_bwd_kernel(x, rstd, dy, dx, n_rows, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """y = x * rstd, rstd = 1 / sqrt(|x|^2 + eps)  ->  dx = rstd * (dy - y (y . dy)), per row of K."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    r = tl.load(rstd + rows, mask=rows < n_rows, other=0.0)
    y = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) * r[:, None]
    d = tl.load(dy + offs, mask=mask, other=0.0)
    tl.store(dx + offs, (r[:, None] * (d - y * tl.sum(y * d, 1)[:, None])).to(dx.dtype.element_ty), mask=mask)
