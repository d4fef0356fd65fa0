"""Readable reference for the chunked MLA prefill (`prefill.mla_prefill`): every head's keys and values decompressed
for the whole prefix and chunk at once, explicit scores, a bottom-right causal mask and a softmax, in float64."""

from __future__ import annotations

import torch


def naive_mla_prefill(
    q: torch.Tensor,
    prefix_rows: torch.Tensor,
    rows: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """q [B, C, H, d_n + d_s], prefix_rows [B, P, d_c + d_s] (P may be 0), rows [B, C, d_c + d_s], w_uk
    [H, d_n, d_c], w_uv [H, d_v, d_c] -> [B, C, H, d_v] in q.dtype.

    Head h: K_h = [W_UK,h c ; k_s] and V_h = W_UV,h c for all P + C tokens; query i of the chunk sits at position
    P + i and sees keys j <= P + i.
    """
    d_c = w_uk.shape[2]
    latent = torch.cat([prefix_rows, rows], dim=1).double()  # (B, P + C, d_c + d_s)
    c, k_s = latent[..., :d_c], latent[..., d_c:]
    B, N, _ = latent.shape
    H, C = q.shape[2], q.shape[1]
    k_n = torch.einsum("hnc,bjc->bjhn", w_uk.double(), c)  # (B, N, H, d_n)
    k = torch.cat([k_n, k_s[:, :, None, :].expand(B, N, H, k_s.shape[-1])], dim=-1)  # (B, N, H, d_n + d_s)
    v = torch.einsum("hvc,bjc->bjhv", w_uv.double(), c)  # (B, N, H, d_v)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k) * scale  # (B, H, C, N)
    position = N - C + torch.arange(C, device=q.device)  # (C,) where each query sits
    visible = torch.arange(N, device=q.device)[None, :] <= position[:, None]  # (C, N)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhij,bjhv->bihv", probs, v).to(q.dtype)
