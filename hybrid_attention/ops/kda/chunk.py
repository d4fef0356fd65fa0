"""`chunk_kda`: chunkwise KDA with backend dispatch ("torch": naive.py, "triton": triton_chunk.py, "fla": FLA 0.6.0,
"auto": `resolve_backend`); every backend computes exactly `recurrent_kda`."""

from __future__ import annotations

import torch

from hybrid_attention.choices import KDA_BACKENDS
from hybrid_attention.ops.backends import use_triton
from hybrid_attention.ops.kda.common import l2_normalize
from hybrid_attention.ops.kda.gate import FUSED_FORMS, check_gate, check_gate_form, kda_gate
from hybrid_attention.ops.kda.naive import naive_chunk_kda
from hybrid_attention.ops.kda.value_heads import repeat_qk_heads, value_head_groups
from hybrid_attention.ops.numerics import compute_dtype

BACKENDS = KDA_BACKENDS
# What "auto" sends to the Triton kernels: a decay or either fused gate.
TRITON_GATES = (None, "bounded", "softplus")


def resolve_backend(backend: str, q: torch.Tensor | None = None, chunk_size: int = 64, gate: str | None = None) -> str:
    """Map a backend name to the one that runs. "auto" is our Triton kernels for CUDA tensors they take (16/32-bit
    floats, chunk size 64, the size they are built for) and the PyTorch reference elsewhere. Unknown names raise."""
    if backend not in BACKENDS:
        raise ValueError(f"chunk_kda: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "auto":
        on_gpu = q is not None and chunk_size == 64 and use_triton(q)  # the one rule (hybrid_attention.ops.backends)
        return "triton" if on_gpu and gate in TRITON_GATES else "torch"
    return backend


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    gate: str | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    use_beta_sigmoid: bool = False,
    return_chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Chunkwise KDA; every backend computes exactly `recurrent_kda`.

    Args:
        q, k: [B, T, Hqk, K] (L2-normalised by the caller unless use_qk_l2norm).
        v: [B, T, Hv, V], Hv a multiple of Hqk: value head j reads query/key head j // (Hv // Hqk)
            (value_heads.py); Hv == Hqk is ordinary multi-head KDA.  Below, H = Hv.
        g: [B, T, H, K]: the natural-log decay (<= 0) when gate is None, else the raw gate logits z.
        beta: [B, T, H], in [0, 1]; logits of any value with use_beta_sigmoid (beta = sigmoid(logits)).
        scale: defaults to K ** -0.5.
        initial_state: [N, H, K, V] float32 (or float64 with float64 inputs); zeros when None.
        output_final_state: return the state after the last token.
        cu_seqlens: int [N + 1]; packs N sequences along T of a batch of one (B == 1).
        chunk_size: 16, 32 or 64 on "torch", 32 or 64 on "fla", 64 on "triton" (docs/kernels.md says why);
            "auto" sends other sizes than 64 to the PyTorch reference.
        backend: "auto", "torch", "triton" or "fla".
        gate: None (g is the decay), "bounded" or "softplus" (g holds logits; the decay is
            `kda_gate(g, A_log, dt_bias, lower_bound, form=gate)`, fused into the Triton kernels, computed first
            elsewhere). A_log [H], dt_bias [H*K] (or [H, K]) go with a gate; lower_bound with "bounded" only
            (None: -5).
        use_qk_l2norm: L2-normalise q and k per head first (fused into the Triton kernels).
        use_beta_sigmoid: beta holds logits; the sigmoid is applied here, with autograd (inside FLA's kernels on
            "fla").
        return_chunk_states: also return the state at the start of every chunk (chunk_states.py): [B, NT, H, K, V],
            or [1, NT_total, H, K, V] with cu_seqlens; float32 (float64), without gradient.
    Returns:
        o [B, T, H, V] in v.dtype, the final state [N, H, K, V] (float32/float64) or None, and with
        return_chunk_states the chunk states.
    """
    groups = value_head_groups(q, k, v, name="chunk_kda")
    if gate is None:
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            raise ValueError(
                'chunk_kda: A_log, dt_bias and lower_bound belong to a gate: pass gate="bounded" or '
                '"softplus" to say that g holds raw logits, or leave them out when g is the decay'
            )
    else:
        check_gate_form(gate, name="chunk_kda", allowed=FUSED_FORMS)
        if A_log is None or dt_bias is None:
            raise ValueError(f"chunk_kda: gate={gate!r} needs A_log and dt_bias")
        if isinstance(q, torch.Tensor) and q.dim() == 4:  # other shapes: the backend's input checks say what is wrong
            H, K = v.shape[2] if groups > 1 else q.shape[2], q.shape[3]
            lb = check_gate(gate, A_log, dt_bias, lower_bound, H=H, K=K, name="chunk_kda", device=q.device)
            lower_bound = lb if gate == "bounded" else None
    backend = resolve_backend(backend, q, chunk_size, gate)
    if backend == "triton" and chunk_size != 64:
        raise ValueError(
            f'chunk_kda: backend="triton" runs chunks of 64 tokens only, got chunk_size={chunk_size!r}; the result '
            'does not depend on the chunk size, so use 64, or backend="torch" or "fla" for states every 32 tokens'
        )
    kwargs = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    if backend != "fla":  # FLA takes shared q/k heads and beta logits itself
        q, k = repeat_qk_heads(q, k, groups)
        if use_beta_sigmoid and isinstance(beta, torch.Tensor) and isinstance(q, torch.Tensor):
            beta = torch.sigmoid(beta.to(compute_dtype(q)))
    if backend == "triton":
        try:  # imported lazily so that the reference works without triton
            from hybrid_attention.ops.kda.triton_chunk import chunk_kda_triton
        except ImportError as exc:
            raise ValueError(f'chunk_kda: backend="triton" is unavailable: {exc!r}') from exc
        fused = dict(gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm)
        return chunk_kda_triton(q, k, v, g, beta, **fused, **kwargs, return_chunk_states=return_chunk_states)
    # The other backends take the decay and normalised q, k: compute them here, with autograd.
    if gate is not None:
        g = kda_gate(g, A_log, dt_bias.reshape(-1), lower_bound, form=gate)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if backend == "torch":
        return naive_chunk_kda(q, k, v, g, beta, **kwargs, return_chunk_states=return_chunk_states)
    from hybrid_attention.ops.kda.fla_backend import chunk_kda_fla

    return chunk_kda_fla(
        q, k, v, g, beta, use_beta_sigmoid=use_beta_sigmoid, return_chunk_states=return_chunk_states, **kwargs
    )
