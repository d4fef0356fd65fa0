"""A model built in code saved as a run directory of its own (config.json and one checkpoint), so that every command
that reads runs (generate, eval, serve, export) loads it: random weights for tests and benchmarks, for instance."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from hybrid_attention.data.tokenizer import BPE_FILE, BPETokenizer
from hybrid_attention.files import atomic_write_text
from hybrid_attention.runs import manifest
from hybrid_attention.runs.checkpoint import save_checkpoint, save_weights
from hybrid_attention.runs.run_config import save_config
from hybrid_attention.training.config import TrainConfig


def save_model_run(out: str | Path, model, tokenizer, *, step: int = 0) -> Path:
    """Write `model` (a `HybridLM`) and `tokenizer` (byte or BPE, matching its vocabulary) to the new run directory
    `out` as the checkpoint of `step`, with the default training settings of a run of that directory. Returns
    `out`."""
    out = Path(out)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"save_model_run: the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}"
        )
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"save_model_run: {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, BPETokenizer):
        atomic_write_text(out / BPE_FILE, tokenizer.to_json())
    train = asdict(TrainConfig.create(out=str(out), tokenizer=tokenizer.kind))
    save_config(out, {"model": model.config.to_dict(), "tokenizer": tokenizer.to_dict(), "train": train})

    def write(directory: Path) -> None:
        save_weights(directory, model, step)
        manifest.write_manifest(directory, kind="single", step=step)

    save_checkpoint(out, step, write)
    return out
