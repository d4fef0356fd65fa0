"""FP8 training of the large projections through torchao's float8 training (`train --fp8`, docs/training.md, "FP8").

Converted: every decoder layer's full-width projections (KDA q, k, v, o; Gated MLA q, gate, o; SwiGLU gate, up,
down). Kept in bf16: the embedding, the LM head, norms, and the low-rank projections that make the KDA kernel's
decay gate and beta and MLA's latent rows, which stay in the precision those kernels take.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from hybrid_attention.choices import FP8_RECIPES

FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "gate_proj", "up_proj", "down_proj")
# FP8 tensor cores: Ada (8.9), Hopper (9.0) and later; torchao's float8 matmul (torch._scaled_mm) needs them.
MIN_CAPABILITY = (8, 9)


def fp8_refusal(device: torch.device | str) -> str | None:
    """Why `train --fp8` cannot run on `device` (one line), or None when it can."""
    if importlib.util.find_spec("torchao") is None:  # found without importing it: its import loads its kernels
        return "--fp8 needs torchao's float8 training, which is not installed: pip install 'hybrid-attention[fp8]'"
    device = torch.device(device)
    if device.type != "cuda":
        return f"--fp8 needs an NVIDIA GPU with FP8 tensor cores (Ada, Hopper or newer); this run is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"--fp8 needs FP8 tensor cores (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: Ada, "
            f"Hopper); the {name} has {capability[0]}.{capability[1]}"
        )
    return None


def check_fp8(device: torch.device | str) -> None:
    """ValueError (one line) unless `train --fp8` can run on `device`."""
    reason = fp8_refusal(device)
    if reason:
        raise ValueError(reason)


def converts(module: nn.Module, name: str) -> bool:
    """Whether `--fp8` converts the nn.Linear `module` at qualified name `name`: a full-width projection of a decoder
    layer, with both sides multiples of 16 (what the FP8 matmul takes)."""
    return (
        type(module) is nn.Linear
        and name.startswith("layers.")
        and name.rsplit(".", 1)[-1] in FP8_LINEARS
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the linears `convert_to_fp8` converts, in module order."""
    return [name for name, m in model.named_modules() if converts(m, name)]


def convert_to_fp8(model: nn.Module, recipe: str = "tensorwise", *, emulate: bool = False) -> list[str]:
    """Swap the linears `converts` picks for torchao's `Float8Linear` (in place; the parameters stay the same objects,
    float32 masters under bf16 autocast) and return their names. `recipe`: "tensorwise" or "rowwise" scaling.
    `emulate`: torchao's emulation of the FP8 matmul in higher precision (any device; for tests)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8 recipe must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    names = fp8_linear_names(model)
    convert_to_float8_training(model, module_filter_fn=lambda m, name: name in names, config=config)
    return names
