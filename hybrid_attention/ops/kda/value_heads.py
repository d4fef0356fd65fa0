"""More value heads than query/key heads (grouped value attention, GVA) for the KDA ops (docs/kernels.md, "The KDA
ops").
"""

from __future__ import annotations

import torch


def value_head_groups(q, k, v, *, name: str) -> int:
    """Value heads per query/key head (1 without GVA). Raises ValueError when v's heads are not a whole multiple of
    q's; other shape errors (k unlike q, wrong g or beta) are left to the op's input checks, which name them."""
    shaped = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
    if not shaped or tuple(k.shape) != tuple(q.shape):
        return 1
    Hqk, Hv = q.shape[2], v.shape[2]
    if Hqk == 0 or Hv == 0 or Hv == Hqk:
        return 1
    if Hv % Hqk:
        raise ValueError(
            f"{name}: v must be [B, T, Hv, V] with Hv a whole multiple of the {Hqk} heads of q and k (groups of value "
            f"heads share a query/key head), got v {tuple(v.shape)} and q {tuple(q.shape)}"
        )
    return Hv // Hqk


def repeat_qk_heads(q: torch.Tensor, k: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, Hqk, K] -> [B, T, Hqk * groups, K], each head repeated `groups` times in place (head j of the
    result is head j // groups of the input). Differentiable: the copies' gradients are summed."""
    if groups == 1:
        return q, k
    return q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)


def value_head_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A zero-copy view of x [B, T, Hqk, K] with `heads` heads, for the shared input checks only (its values are
    not the repeated heads): shape, dtype and device are what the checks read."""
    return x[:, :, :1].expand(x.shape[0], x.shape[1], heads, x.shape[3])
