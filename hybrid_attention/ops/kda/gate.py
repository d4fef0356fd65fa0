"""The KDA decay gates, "bounded", "softplus" and "head": the per-step log decay g <= 0 from raw gate logits z, and the
one check of a gate's parameters (docs/math.md, "Decay gates"; docs/kernels.md, "The KDA ops").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_attention.checks import check_lower_bound
from hybrid_attention.choices import GATE_FORMS
from hybrid_attention.ops.numerics import compute_dtype

# The forms the chunk op and the decode kernels compute from logits inside the kernels ("head" is "softplus" on
# logits repeated over K, see `head_as_channels`).
FUSED_FORMS = ("bounded", "softplus")
DEFAULT_LOWER_BOUND = -5.0
# Integer codes of the fused forms inside the Triton kernels (0: g is already the decay).
FORM_CODES = {None: 0, "bounded": 1, "softplus": 2}


def check_gate_form(form, *, name: str, allowed: tuple[str, ...] = GATE_FORMS) -> str:
    if form not in allowed:
        raise ValueError(f"{name}: gate must be one of {', '.join(map(repr, allowed))}, got {form!r}")
    return form


def check_gate(
    form: str,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    *,
    H: int,
    K: int,
    name: str,
    device: torch.device | None = None,
    allowed: tuple[str, ...] = GATE_FORMS,
) -> float:
    """Validate a gate's form and parameters for H heads of K channels; raise ValueError naming what is wrong.

    A_log: [H]. dt_bias: [H*K] or [H, K] per channel ([H] for "head"). lower_bound: only for "bounded" (None there
    means DEFAULT_LOWER_BOUND); the other forms take None. Returns the lower bound to use (0.0 for the unbounded
    forms, where the kernels ignore it)."""
    check_gate_form(form, name=name, allowed=allowed)
    if form == "bounded":
        lb = check_lower_bound(DEFAULT_LOWER_BOUND if lower_bound is None else lower_bound, name=name)
    elif lower_bound is not None:
        raise ValueError(f'{name}: lower_bound applies to the "bounded" gate only, got {lower_bound!r} with {form!r}')
    else:
        lb = 0.0
    for label, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {label} must be a floating tensor, got {kind}")
        if device is not None and t.device != device:
            raise ValueError(f"{name}: {label} is on {t.device} but the inputs are on {device}")
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"{name}: A_log must be [H] = [{H}], got shape {tuple(A_log.shape)}")
    bias_shapes = ((H,),) if form == "head" else ((H * K,), (H, K))
    if tuple(dt_bias.shape) not in bias_shapes:
        want = "[H]" if form == "head" else "[H*K] (or [H, K])"
        raise ValueError(
            f"{name}: dt_bias must be {want} = {list(bias_shapes[0])} for the {form!r} gate, "
            f"got shape {tuple(dt_bias.shape)}"
        )
    return lb


def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
    *,
    form: str = "bounded",
) -> torch.Tensor:
    """Log decay from the raw decay logits.

    Args:
        z: [..., H, K] raw decay logits per channel ([..., H] for form "head").
        A_log: [H] per-head log rate.
        dt_bias: [H*K] per-channel bias, viewed as [H, K] ([H] for "head").
        lower_bound: the most negative decay per step of the "bounded" form (finite, < 0; None means -5);
            must be None for the other forms.
        form: "bounded", "softplus" or "head" (docs/math.md, "Decay gates").
    Returns:
        g: the shape of z, float32 (float64 when z is float64), <= 0; in [lower_bound, 0] for "bounded".
    Computed in float32/float64 whatever the input dtype, so bf16 logits do not coarsen the decay.
    """
    check_gate_form(form, name="kda_gate")
    if not isinstance(z, torch.Tensor) or not z.is_floating_point():
        raise ValueError(f"kda_gate: z must be a floating tensor, got {getattr(z, 'dtype', type(z).__name__)}")
    if z.dim() < (1 if form == "head" else 2):
        want = "[..., H]" if form == "head" else "[..., H, K]"
        raise ValueError(f"kda_gate: z must be {want} for the {form!r} gate, got shape {tuple(z.shape)}")
    H, K = (z.shape[-1], 1) if form == "head" else z.shape[-2:]
    lb = check_gate(form, A_log, dt_bias, lower_bound, H=H, K=K, name="kda_gate")
    dtype = compute_dtype(z)
    rate = A_log.to(dtype).exp()
    if form == "head":
        return -rate * F.softplus(z.to(dtype) + dt_bias.to(dtype))
    u = z.to(dtype) + dt_bias.to(dtype).view(H, K)
    if form == "softplus":
        return -rate.unsqueeze(-1) * F.softplus(u)
    return lb * torch.sigmoid(rate.unsqueeze(-1) * u)


def head_as_channels(z: torch.Tensor, dt_bias: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The "head" gate as the per-channel "softplus" gate: z [..., H] -> [..., H, K] and dt_bias [H] -> [H*K], each
    value repeated over the K channels of its head, so that kda_gate(z, A_log, dt_bias, form="head") broadcast over
    K equals kda_gate(*head_as_channels(...), form="softplus") exactly (the fused kernels then compute it)."""
    return z.unsqueeze(-1).expand(*z.shape, K), dt_bias.repeat_interleave(K)
