"""transformers' own KDA and MLA layers as ours, on the same weights (Kimi Linear, GLM-5-next): `convert_kda`,
`convert_mla` (docs/transformers.md, "Converting transformers' layers").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybrid_attention.layers.kda import KimiDeltaAttention
from hybrid_attention.layers.mla import GatedMLA


def _reject(layer: nn.Module, what: str) -> None:
    raise ValueError(f"convert: {type(layer).__name__} {what}; the layer has no counterpart here")


def _no_bias(layer: nn.Module, names: list[str]) -> None:
    for name in names:
        module = layer.get_submodule(name)
        if getattr(module, "bias", None) is not None:
            _reject(layer, f"has a bias on {name}")


def _like(source: nn.Module, target: nn.Module) -> nn.Module:
    """`target` on the device and dtype of `source`'s parameters, in the same train/eval mode."""
    param = next(source.parameters())
    return target.to(device=param.device, dtype=param.dtype).train(source.training)


def convert_kda(layer: nn.Module, *, backend: str = "auto") -> KimiDeltaAttention:
    """A transformers KDA layer (glm5_next `Glm5NextTextLinearAttention`, kimi_linear `KimiLinearDeltaAttention`)
    as a `KimiDeltaAttention` with the same weights and decay gate: "bounded" with GLM-5-next's lower bound, or
    Kimi Linear's "softplus". `backend`: our `chunk_kda` backend."""
    for name in ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm"):
        if not hasattr(layer, name):
            raise ValueError(f"convert_kda: {type(layer).__name__} has no `{name}`; expected a transformers KDA layer")
    gate = layer.forget_gate
    H, D = layer.num_heads, layer.head_dim
    dim = H * D
    if layer.activation != "silu":
        _reject(layer, f"applies {layer.activation!r} after its short conv (ours applies SiLU)")
    if layer.conv1d.bias is not None:
        _reject(layer, "has a bias on its short conv")
    if getattr(layer.o_norm, "activation", "sigmoid") != "sigmoid":
        _reject(layer, f"gates its output norm with {layer.o_norm.activation!r} (ours: sigmoid)")
    # g_b_proj may have a bias: our g_up has one.
    _no_bias(layer, ["q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "o_proj"])
    _no_bias(layer, ["forget_gate.f_a_proj", "forget_gate.f_b_proj"])
    # GLM-5-next's gate is bounded unless its lower bound is None; Kimi Linear's is always the softplus gate.
    lower_bound = getattr(gate, "safe_gate_lower_bound", None)
    form = "softplus" if lower_bound is None else "bounded"

    ours = KimiDeltaAttention(
        layer.hidden_size,
        H,
        head_dim=D,
        conv_size=layer.conv_kernel_size,
        lower_bound=-5.0 if lower_bound is None else float(lower_bound),  # the softplus gate has none
        norm_eps=layer.o_norm.variance_epsilon,
        backend=backend,
        gate=form,
    )
    conv = layer.conv1d.weight  # (3 * dim, 1, W): q, k, v channels
    g_up_bias = layer.g_b_proj.bias
    state = {
        "q_proj.weight": layer.q_proj.weight,
        "k_proj.weight": layer.k_proj.weight,
        "v_proj.weight": layer.v_proj.weight,
        "q_conv.weight": conv[:dim],
        "k_conv.weight": conv[dim : 2 * dim],
        "v_conv.weight": conv[2 * dim :],
        "b_proj.weight": layer.b_proj.weight,
        "f_down.weight": gate.f_a_proj.weight,
        "f_up.weight": gate.f_b_proj.weight,
        "A_log": gate.A_log.reshape(H),  # glm5_next: [H]; kimi_linear: [1, 1, H, 1]
        "dt_bias": gate.dt_bias,
        "g_down.weight": layer.g_a_proj.weight,
        "g_up.weight": layer.g_b_proj.weight,
        "g_up.bias": torch.zeros(dim) if g_up_bias is None else g_up_bias,
        "o_norm.weight": layer.o_norm.weight,
        "o_proj.weight": layer.o_proj.weight,
    }
    ours = _like(layer, ours)
    ours.load_state_dict({k: v.detach() for k, v in state.items()})
    return ours


def convert_mla(layer: nn.Module) -> GatedMLA:
    """A transformers kimi_linear MLA layer (`KimiLinearAttention`, NoPE) as a `GatedMLA` without output gate."""
    for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        if not hasattr(layer, name):
            raise ValueError(f"convert_mla: {type(layer).__name__} has no `{name}`; expected a transformers MLA layer")
    H = layer.num_heads
    d_n, d_s, d_v, d_c = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.kv_lora_rank
    d_q = layer.q_lora_rank
    if getattr(layer, "num_key_value_groups", 1) != 1:
        _reject(layer, f"groups its KV heads ({layer.num_key_value_groups} query heads per KV head)")
    if not math.isclose(layer.scaling, (d_n + d_s) ** -0.5, rel_tol=1e-12):
        _reject(layer, f"scales scores by {layer.scaling} (ours: (d_n + d_s) ** -0.5 = {(d_n + d_s) ** -0.5})")
    q_names = ["q_proj"] if d_q is None else ["q_a_proj", "q_b_proj"]
    _no_bias(layer, [*q_names, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    eps = layer.kv_a_layernorm.variance_epsilon
    if d_q is not None and layer.q_a_layernorm.variance_epsilon != eps:
        _reject(layer, f"uses two norm epsilons ({layer.q_a_layernorm.variance_epsilon}, {eps}); ours shares one")

    ours = GatedMLA(
        layer.hidden_size,
        H,
        kv_lora_rank=d_c,
        qk_nope_head_dim=d_n,
        qk_shared_head_dim=d_s,
        v_head_dim=d_v,
        q_lora_rank=d_q,
        norm_eps=eps,
        output_gate=False,
    )
    kv_a = layer.kv_a_proj_with_mqa.weight  # (d_c + d_s, hidden)
    kv_b = layer.kv_b_proj.weight.view(H, d_n + d_v, d_c)  # per head: [W_UK,h ; W_UV,h]
    state = {
        "kv_down.weight": kv_a[:d_c],
        "k_shared.weight": kv_a[d_c:],
        "kv_norm.weight": layer.kv_a_layernorm.weight,
        "k_up.weight": kv_b[:, :d_n].reshape(H * d_n, d_c),
        "v_up.weight": kv_b[:, d_n:].reshape(H * d_v, d_c),
        "o_proj.weight": layer.o_proj.weight,
    }
    if d_q is None:
        state["q_proj.weight"] = layer.q_proj.weight
    else:
        state["q_down.weight"] = layer.q_a_proj.weight
        state["q_norm.weight"] = layer.q_a_layernorm.weight
        state["q_up.weight"] = layer.q_b_proj.weight
    ours = _like(layer, ours)
    ours.load_state_dict({k: v.detach() for k, v in state.items()})
    return ours
