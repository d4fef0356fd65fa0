"""Problems for the absorbed MLA decode tests (CPU and GPU): random weights, queries and a latent cache, and the
float64 reference over the decompressed per-head keys and values (docs/math.md, "Absorbed decode")."""

from __future__ import annotations

import torch


def make_problem(
    lens,
    Tq,
    *,
    d_c,
    d_s,
    H,
    d_n,
    d_v,
    max_len=None,
    spare=5,
    seed=0,
    poison=float("nan"),
    dtype=torch.float32,
    device="cpu",
    sharpen_heads=False,
):
    """Random weights, queries and a cache of `max_len` (default max(lens) + spare) rows per sequence, stored in
    `dtype`; rows past each length hold `poison`. Keys: q_n, q_s, w_uk, w_uv (float32), seq_lens (int32), rows
    [B, max_len, d_c + d_s], q64 (the absorbed query [B, Tq, H, d_c + d_s] in float64), q (q64 in `dtype`), scale,
    d_c. With `sharpen_heads` head h's softmax temperature grows with h, so heads differ in how peaked they are."""
    g = torch.Generator(device=device).manual_seed(seed)
    B = len(lens)
    max_len = max_len or max(lens) + spare
    f = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    sharp = torch.linspace(0.5, 3.0, H, device=device)[:, None] if sharpen_heads else 1.0
    p = dict(
        q_n=f(B, Tq, H, d_n) * sharp,
        q_s=f(B, Tq, H, d_s) * sharp,
        w_uk=f(H, d_n, d_c) / d_c**0.5,
        w_uv=f(H, d_v, d_c) / d_c**0.5,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        scale=(d_n + d_s) ** -0.5,
        d_c=d_c,
    )
    rows = torch.cat([f(B, max_len, d_c), f(B, max_len, d_s)], dim=-1).to(dtype)  # the cache is stored in dtype
    for b, L in enumerate(lens):
        rows[b, L:] = poison
    p["rows"] = rows
    q_abs = torch.einsum("bthn,hnc->bthc", p["q_n"].double(), p["w_uk"].double())  # W_UK folded into the query
    p["q64"] = torch.cat([q_abs, p["q_s"].double()], dim=-1)
    p["q"] = p["q64"].to(dtype)
    return p


def decompressed_reference(p):
    """[B, Tq, H, d_v] in float64 from the stored rows: explicit per-head keys [W_UK,h c ; k_s] and values W_UV,h c,
    bottom-right causal over each seq_lens[b], with the unrounded queries."""
    q_n, q_s, w_uk, w_uv = (p[k].double() for k in ("q_n", "q_s", "w_uk", "w_uv"))
    B, Tq, H, _ = q_n.shape
    d_c, dev = p["d_c"], p["rows"].device
    outs = []
    for b in range(B):
        L = int(p["seq_lens"][b])
        c, k_s = p["rows"][b, :L, :d_c].double(), p["rows"][b, :L, d_c:].double()
        k = torch.cat([torch.einsum("hnc,jc->jhn", w_uk, c), k_s[:, None, :].expand(L, H, -1)], dim=-1)
        v = torch.einsum("hvc,jc->jhv", w_uv, c)
        s = torch.einsum("thd,jhd->thj", torch.cat([q_n[b], q_s[b]], dim=-1), k) * p["scale"]
        visible = torch.arange(L, device=dev)[None, :] <= (L - Tq + torch.arange(Tq, device=dev))[:, None]  # (Tq, L)
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        outs.append(torch.einsum("thj,jhv->thv", torch.softmax(s, dim=-1), v))
    return torch.stack(outs)


def up_project(p, o_lat):
    """Apply W_UV,h to the latent output: [B, Tq, H, d_c] -> [B, Tq, H, d_v] in float64, on the problem's device."""
    w_uv = p["w_uv"].double()
    return torch.einsum("bthc,hvc->bthv", o_lat.double().to(w_uv.device), w_uv)
