"""A training run directory as a transformers model directory: `hybrid-attention export --ckpt RUN --hf OUT_DIR`.

OUT_DIR gets what `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` read: config.json
(model type "hybrid_attention"), model.safetensors, generation_config.json and the tokenizer as a
`PreTrainedTokenizerFast` (tokenizer.json and its config). A BPE run exports its own `tokenizers` file; the byte
tokenizer becomes a byte-level BPE with no merges, whose ids are the byte values, so both encode exactly as the run
does. `import hybrid_attention.hf` registers the model type with transformers before loading.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybrid_attention.data.tokenizer import BPETokenizer, ByteTokenizer, byte_alphabet
from hybrid_attention.hf.modeling import HybridAttentionForCausalLM
from hybrid_attention.runs.checkpoint import load_run


def byte_level_tokenizer() -> Tokenizer:
    """The byte tokenizer as a `tokenizers.Tokenizer`: id b is the byte b (in the byte-level alphabet), no merges."""
    vocab = {char: byte for byte, char in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def hf_tokenizer(tokenizer: ByteTokenizer | BPETokenizer) -> PreTrainedTokenizerFast:
    """A run's tokenizer as a transformers fast tokenizer that encodes to the same ids (no special tokens). It pads
    on the left, the side generation needs (new tokens follow the last column)."""
    if isinstance(tokenizer, ByteTokenizer):
        tok = byte_level_tokenizer()
    elif isinstance(tokenizer, BPETokenizer):
        tok = Tokenizer.from_str(tokenizer.to_json())
    else:
        raise ValueError(f"unknown tokenizer {type(tokenizer).__name__}; expected the byte or BPE tokenizer")
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, padding_side="left")


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the run in `run_dir` (its last checkpoint) to `out_dir` as a transformers model directory, which must
    not exist or be empty. Returns `out_dir`."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory; choose a new one")
    model, _, tokenizer = load_run(run_dir)
    wrapper = HybridAttentionForCausalLM.from_hybrid_lm(model)
    out.mkdir(parents=True, exist_ok=True)
    wrapper.save_pretrained(out)
    hf_tokenizer(tokenizer).save_pretrained(out)
    return out
