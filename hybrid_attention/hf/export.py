"""A training run directory as a transformers model directory: `hybrid-attention export --ckpt RUN --hf OUT_DIR`
(docs/transformers.md, "Export and remote code").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybrid_attention.data.tokenizer import BPETokenizer, ByteTokenizer, byte_alphabet
from hybrid_attention.files import default_permissions, fsync
from hybrid_attention.hf.modeling import HybridAttentionForCausalLM
from hybrid_attention.hf.remote_code import write_remote_code
from hybrid_attention.runs.checkpoint import load_run


def byte_level_tokenizer() -> Tokenizer:
    """The byte tokenizer as a `tokenizers.Tokenizer`: id b is the byte b (in the byte-level alphabet), no merges."""
    vocab = {char: byte for byte, char in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def hf_tokenizer(tokenizer: ByteTokenizer | BPETokenizer) -> PreTrainedTokenizerFast:
    """A run's tokenizer as a transformers fast tokenizer that encodes to the same ids (no special tokens added). Its
    end-of-document token is the end (`eos_token`), where the run has one. It pads on the left, the side generation
    needs (new tokens follow the last column), with the NUL byte's token: neither tokenizer has a padding token of
    its own, and padded positions are masked anyway."""
    if isinstance(tokenizer, ByteTokenizer):
        tok = byte_level_tokenizer()
    elif isinstance(tokenizer, BPETokenizer):
        tok = Tokenizer.from_str(tokenizer.to_json())
    else:
        raise ValueError(f"unknown tokenizer {type(tokenizer).__name__}; expected the byte or BPE tokenizer")
    eos = None if tokenizer.eod_id is None else tok.id_to_token(tokenizer.eod_id)
    # split_special_tokens: a NUL byte (or its stand-in character) in the text still encodes as the byte it is.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        pad_token=byte_alphabet()[0],
        eos_token=eos,
        split_special_tokens=True,
    )


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the run in `run_dir` (its last checkpoint) to `out_dir` as a transformers model directory, which must
    not exist or be empty. The files are written into a temporary folder beside it (`.NAME.partial`, removed when a
    new export starts) that is renamed to `out_dir` once whole. Returns `out_dir`."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory; choose a new one")
    model, _, tokenizer = load_run(run_dir)
    tok = hf_tokenizer(tokenizer)
    wrapper = HybridAttentionForCausalLM.from_hybrid_lm(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted export left
    tmp.mkdir()
    try:
        wrapper.config.auto_map = write_remote_code(tmp)
        wrapper.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for path in tmp.iterdir():
            default_permissions(path)  # safetensors writes 0600
            fsync(path)
        fsync(tmp, directory=True)
        os.rename(tmp, out)  # over an empty directory too (POSIX)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(out.parent, directory=True)
    return out
