"""What `hybrid-attention serve` serves: a run directory, a transformers folder written by `export --hf`, or a
preset with random weights and the byte vocabulary (to measure the server; its text is noise)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _is_transformers_folder(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type") == "hybrid_attention"
    except (OSError, ValueError, AttributeError):
        return False


def load_for_serving(
    *,
    ckpt: str | None = None,
    preset: str | None = None,
    device: torch.device,
    dtype: torch.dtype,
    kda_backend: str = "auto",
    attnres_backend: str = "auto",
    seed: int = 0,
):
    """(model in eval mode on `device` in `dtype`, tokenizer, the name it is served under) from exactly one of
    `ckpt` (a run directory or an exported transformers folder) and `preset`."""
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.data.tokenizer import ByteTokenizer
    from hybrid_attention.model import HybridLM
    from hybrid_attention.runs.checkpoint import load_run

    if (ckpt is None) == (preset is None):
        raise ValueError("serve: pass --ckpt RUN_DIR (or an exported transformers folder) or --preset NAME")
    if preset is not None:
        torch.manual_seed(seed)
        with torch.device(device):  # the random initialisation runs where the model will live
            model = HybridLM(
                HybridConfig.from_preset(preset, vocab_size=256),
                kda_backend=kda_backend,
                attnres_backend=attnres_backend,
            )
        tokenizer, name = ByteTokenizer(), f"{preset}-random"
    elif _is_transformers_folder(Path(ckpt)):
        try:
            from transformers import AutoModelForCausalLM

            import hybrid_attention.hf  # noqa: F401  (registers the model type with transformers)
        except ImportError:
            raise ValueError(f"{ckpt} is a transformers folder: pip install 'hybrid-attention[hf]'") from None
        model = AutoModelForCausalLM.from_pretrained(ckpt).model
        tokenizer, name = exported_tokenizer(Path(ckpt)), Path(ckpt).resolve().name
    else:
        model, _, tokenizer = load_run(ckpt, device, kda_backend=kda_backend, attnres_backend=attnres_backend)
        name = Path(ckpt).resolve().name
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"{ckpt}: the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}"
        )
    return model.to(device=device, dtype=dtype).eval(), tokenizer, name


def exported_tokenizer(folder: Path):
    """The tokenizer of an `export --hf` folder as the run's own: its byte-level vocabulary without merges is the
    byte tokenizer (the end token, when the folder names one, ends documents), anything else a BPE."""
    from hybrid_attention.data.tokenizer import BYTE_EOD, BPETokenizer, ByteTokenizer, byte_alphabet

    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("merges") or model.get("vocab") != {char: byte for byte, char in byte_alphabet().items()}:
        return BPETokenizer.load(folder / "tokenizer.json")
    config = folder / "tokenizer_config.json"
    eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
    return ByteTokenizer(eod_id=BYTE_EOD if eos == byte_alphabet()[BYTE_EOD] else None)
