"""A run's config.json: its sections saved, read back and checked as strictly as command-line input (docs/training.md,
"Run directories and checkpoints").
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

from hybrid_attention.checks import is_finite_number, is_int
from hybrid_attention.files import atomic_write_text

CONFIG = "config.json"
FORMAT = "hybrid-attention-run"
# Every model setting a run has stored since the format began; settings added later fall back to their defaults.
MODEL_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "layer_types",
    "intermediate_size",
    "residual",
    "attnres_block_size",
    "norm_eps",
    "kda_num_heads",
    "kda_head_dim",
    "kda_conv_size",
    "kda_lower_bound",
    "mla_num_heads",
    "mla_kv_lora_rank",
    "mla_qk_nope_head_dim",
    "mla_qk_shared_head_dim",
    "mla_v_head_dim",
    "mla_q_lora_rank",
    "tie_embeddings",
    "init_std",
)


def _type_error(value, hint) -> str | None:
    """Why `value` (read from JSON) does not have the type `hint` (a dataclass annotation), or None when it has."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        reasons = [_type_error(value, h) for h in typing.get_args(hint)]
        return None if None in reasons else " or ".join(r.removeprefix("expected ") for r in reasons if r)
    if hint is type(None):
        return None if value is None else "expected null"
    if hint is bool:
        return None if isinstance(value, bool) else "expected true or false"
    if hint is int:
        return None if is_int(value) else "expected an integer"
    if hint is float:
        return None if is_finite_number(value) else "expected a finite number"
    if hint is str:
        return None if isinstance(value, str) else "expected a string"
    if typing.get_origin(hint) is tuple:  # tuple[str, ...] or tuple[int, ...], stored as a JSON list
        item = typing.get_args(hint)[0]
        ok = isinstance(value, list) and all(_type_error(v, item) is None for v in value)
        return None if ok else f"expected a list of {'integers' if item is int else 'strings'}"
    return None  # a type without a JSON rule here: the dataclass's own checks apply


def check_fields(values: dict, cls, where: str, *, required: tuple[str, ...] = ()) -> None:
    """Check a JSON section against the init fields of dataclass `cls` as strictly as command-line input: unknown or
    missing required keys, and values of the wrong type, raise ValueError naming `where` (e.g. "run/config.json
    train section")."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in cls.__dataclass_fields__.values() if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown}")
    missing = [name for name in required if name not in values]
    if missing:
        raise ValueError(f"{where}: missing settings {missing}")
    for name in sorted(values):
        reason = _type_error(values[name], hints[name])
        if reason:
            raise ValueError(f"{where}: {name} = {json.dumps(values[name])[:40]}; {reason}")


def save_config(run_dir: str | Path, config: dict) -> None:
    atomic_write_text(Path(run_dir) / CONFIG, json.dumps({"format": FORMAT, **config}, indent=2) + "\n")


def load_config(run_dir: str | Path) -> dict:
    """The run's config.json as a dict, its model and tokenizer sections checked; ValueError when the directory is
    not a run or the file is damaged. (The train section is checked by `TrainConfig.create`.)"""
    from hybrid_attention.config import EXECUTION_FIELDS, HybridConfig

    path = Path(run_dir) / CONFIG
    if not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: {CONFIG} is missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f'{path} was not written by hybrid-attention (no "format": "{FORMAT}")')
    for key in ("model", "tokenizer", "train"):
        if not isinstance(config.get(key), dict):
            raise ValueError(f"{path} has no {key!r} section")
    # num_layers is derived, the execution choices are load-time arguments (`HybridConfig.from_dict` says so)
    model = {k: v for k, v in config["model"].items() if k not in ("num_layers", *EXECUTION_FIELDS)}
    check_fields(model, HybridConfig, f"{path} model section", required=MODEL_REQUIRED)
    tokenizer = config["tokenizer"]
    if tokenizer.get("kind") not in ("byte", "bpe"):
        raise ValueError(f"{path} tokenizer section: kind = {tokenizer.get('kind')!r}; expected 'byte' or 'bpe'")
    vocab = tokenizer.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"{path} tokenizer section: vocab_size = {vocab!r}; expected a positive integer")
    if "file" in tokenizer and not isinstance(tokenizer["file"], str):
        raise ValueError(f"{path} tokenizer section: file = {tokenizer['file']!r}; expected a file name")
    return config


def read_model_config(path: str | Path, preset: str) -> dict:
    """The model settings of `train --model-config FILE`: a JSON object of HybridConfig fields to set over `preset`'s,
    checked as strictly as config.json's model section and then as a whole model; ValueError naming the file."""
    from hybrid_attention.config import HybridConfig

    where = f"--model-config {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte {e.start})") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a JSON object of model settings, got {type(values).__name__}")
    check_fields(values, HybridConfig, where)
    if "vocab_size" in values:
        raise ValueError(f"{where}: vocab_size is the tokenizer's (--tokenizer, --vocab-size); leave it out")
    try:
        HybridConfig.from_preset(preset, **values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return values
