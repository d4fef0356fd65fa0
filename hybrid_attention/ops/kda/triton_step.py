"""The fused recurrent KDA step for decoding, `fused_recurrent_kda_step`: a few tokens per sequence from a float32
state updated in place (the kernel, its launch, and the custom op `hybrid_attention::kda_recurrent_step` under
torch.compile); docs/kernels.md, "Decode step"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybrid_attention.ops.kda.common import resolve_scale
from hybrid_attention.ops.kda.gate import FORM_CODES, FUSED_FORMS, check_gate
from hybrid_attention.ops.kda.triton_utils import L2_EPS, MAX_DIM, empty, load_state, state_slice, store_state
from hybrid_attention.ops.triton_support import triton_runs_on


@triton.jit
def _step_kernel(
    q,
    k,
    v,
    g,
    beta,
    a_log,
    dt_bias,
    state,
    o,  # q, k, g [B, T, H, K]; v, o [B, T, H, V]; state [B or P, H, K, V] f32
    rows,
    scale,
    lower_bound,
    T,  # rows: int64 [B], the state row of each sequence (read only with INDEXED)
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    L2NORM: tl.constexpr,
    INDEXED: tl.constexpr,
):
    iv = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    soffs, smask = state_slice(iv, K, V, BK, BV)
    srow = b.to(tl.int64)
    live = b >= 0  # always true without a pool
    if INDEXED:
        slot = tl.load(rows + b)
        live = slot >= 0
        srow = tl.maximum(slot, 0)
    # live widened to a [BK, BV] block before the &: the interpreter refuses a block & scalar mask
    smask = smask & ((tl.zeros([BK, BV], dtype=tl.int32) + live.to(tl.int32)) != 0)
    S = load_state(state, srow * H + h, soffs, smask, True, K, V, BK, BV)
    if GATE != 0:
        bias = tl.load(dt_bias + h * K + rk, mask=mk, other=0.0).to(tl.float32)
        rate = tl.exp(tl.load(a_log + h).to(tl.float32))
    for t in range(0, T):
        row = ((b * T + t) * H + h).to(tl.int64)
        qt = tl.load(q + row * K + rk, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + row * K + rk, mask=mk, other=0.0).to(tl.float32)
        gt = tl.load(g + row * K + rk, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + row * V + rv, mask=mv, other=0.0).to(tl.float32)
        bt = tl.load(beta + row).to(tl.float32)
        if L2NORM:
            qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + L2_EPS)
            kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + L2_EPS)
        if GATE == 1:
            gt = tl.where(mk, lower_bound * tl.sigmoid(rate * (gt + bias)), 0.0)
        elif GATE == 2:
            u = gt + bias
            gt = tl.where(mk, -rate * tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(tl.minimum(u, 20.0)))), 0.0)
        S = S * tl.exp(gt)[:, None]
        vn = bt * (vt - tl.sum(S * kt[:, None], 0))  # beta_t (v_t - S^T k_t)
        S = S + kt[:, None] * vn[None, :]
        ot = tl.where(live, scale * tl.sum(S * qt[:, None], 0), 0.0)
        tl.store(o + row * V + rv, ot.to(o.dtype.element_ty), mask=mv)
    store_state(state, srow * H + h, S, soffs, smask, K, V)


def value_tile(V: int) -> int:
    """State columns per program: up to 64 (at K = V = 128, 64 columns beat 32 at every batch size measured)."""
    return min(64, max(16, triton.next_power_of_2(V)))


def _launch_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    a_log: Tensor | None,
    dt_bias: Tensor | None,
    scale: float,
    lower_bound: float,
    gate: int,
    l2norm: bool,
    state_indices: Tensor | None = None,
) -> Tensor:
    """The kernel launch (also the custom op's body); arguments checked by fused_recurrent_kda_step."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = empty(v, B, T, H, V)
    BK = max(16, triton.next_power_of_2(K))
    BV = value_tile(V)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    _step_kernel[(triton.cdiv(V, BV), B, H)](
        q,
        k,
        v,
        g,
        beta,
        a_log if gate else state,
        dt_bias if gate else state,
        state,
        o,  # state: an unused pointer
        state if state_indices is None else state_indices,
        scale,
        lower_bound,
        T,
        H=H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        GATE=gate,
        L2NORM=l2norm,
        INDEXED=state_indices is not None,
        num_warps=4 if BK <= 128 else 8,
    )
    return o


@torch.library.custom_op("hybrid_attention::kda_recurrent_step", mutates_args=("state",))
def _step_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    a_log: Tensor | None,
    dt_bias: Tensor | None,
    scale: float,
    lower_bound: float,
    gate: int,
    l2norm: bool,
    state_indices: Tensor | None,
) -> Tensor:
    return _launch_step(q, k, v, g, beta, state, a_log, dt_bias, scale, lower_bound, gate, l2norm, state_indices)


@_step_op.register_fake
def _(q, k, v, g, beta, state, a_log, dt_bias, scale, lower_bound, gate, l2norm, state_indices):
    return empty(v, *v.shape)


def fused_recurrent_kda_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    scale: float | None = None,
    gate: str | None = None,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    state_indices: Tensor | None = None,
) -> Tensor:
    """Advance `state` by T tokens (T small: decoding) and return their outputs; forward only.

    Args:
        q, k, g: [B, T, H, K] (g the natural-log decay, or with gate "bounded" / "softplus" the raw logits z, as
            in chunk_kda).  v: [B, T, H, V].  beta: [B, T, H].  K, V <= 256.
        state: [B, H, K, V] float32, contiguous; updated in place. With state_indices, a pool [P, H, K, V].
        state_indices: int64 [B] or None: sequence b reads and writes pool row state_indices[b] (distinct rows); a
            negative entry is a padding slot, whose outputs are zeros and which touches no row.
        scale: defaults to K ** -0.5.  use_qk_l2norm: L2-normalise q and k inside the kernel.
    Returns:
        o: [B, T, H, V] in v.dtype.
    """
    name = "fused_recurrent_kda_step"
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T < 1 or H < 1 or K < 1:
        raise ValueError(f"{name}: q must have T, H, K >= 1, got shape {tuple(q.shape)}")
    for label, t in (("k", k), ("g", g)):
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{name}: {label} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{name}: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    V = v.shape[3]
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"{name}: beta must be [B, T, H] = {(B, T, H)}, got shape {tuple(beta.shape)}")
    rows = B if state_indices is None else "P"
    if state_indices is not None and (
        state_indices.dtype != torch.int64 or tuple(state_indices.shape) != (B,) or state_indices.device != state.device
    ):
        raise ValueError(
            f"{name}: state_indices must be an int64 [B] = [{B}] tensor on {state.device}, got "
            f"{state_indices.dtype} {tuple(state_indices.shape)} on {state_indices.device}"
        )
    state_rows = B if state_indices is None else (state.shape[0] if state.dim() == 4 else -1)
    if tuple(state.shape) != (state_rows, H, K, V) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(
            f"{name}: state must be a contiguous float32 [{rows}, H, K, V] = [{rows}, {H}, {K}, {V}] tensor (it is "
            f"updated in place), got {state.dtype} {tuple(state.shape)}"
            f"{'' if state.is_contiguous() else ' non-contiguous'}"
        )
    if K > MAX_DIM or V < 1 or V > MAX_DIM:
        raise ValueError(f"{name}: K and V must be in [1, {MAX_DIM}], got K = {K}, V = {V}")
    for label, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: {label} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device != state.device:
            raise ValueError(f"{name}: {label} is on {t.device} but state is on {state.device}")
    if not triton_runs_on(state):
        raise ValueError(f"{name}: needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {state.device}")
    if gate is None:
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            raise ValueError(f'{name}: A_log, dt_bias and lower_bound need gate="bounded" or "softplus"')
        lb = 0.0
    else:
        lb = check_gate(
            gate, A_log, dt_bias, lower_bound, H=H, K=K, name=name, device=state.device, allowed=FUSED_FORMS
        )
        A_log, dt_bias = A_log.contiguous(), dt_bias.reshape(H, K).contiguous()
    scale = resolve_scale(scale, K, name=name)
    # The custom op's dispatch costs tens of microseconds of host time per call, as long as the whole step at small
    # batches, so eager calls launch the kernel directly; traced calls need the op.
    step = _step_op if torch.compiler.is_compiling() else _launch_step
    return step(
        q, k, v, g, beta, state, A_log, dt_bias, scale, lb, FORM_CODES[gate], bool(use_qk_l2norm), state_indices
    )
