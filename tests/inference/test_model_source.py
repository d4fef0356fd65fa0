"""What `serve` loads: a run directory, the transformers folder `export --hf` writes of it (the same model and token
ids), or a preset's random weights with the byte vocabulary; one of them, named."""

from __future__ import annotations

import pytest
import torch

from hybrid_attention.inference.model_source import load_for_serving
from tests.inference.serving import write_run

CPU = dict(device=torch.device("cpu"), dtype=torch.float32)


def test_run_directory_and_its_transformers_export_serve_the_same_model(tmp_path, quiet_transformers):
    pytest.importorskip("transformers")
    from hybrid_attention.hf.export import export_run

    run = write_run(tmp_path / "run")
    exported = export_run(run, tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 9))
    (model, tokenizer, name), (hf_model, hf_tokenizer, hf_name) = (
        load_for_serving(ckpt=str(path), **CPU) for path in (run, exported)
    )
    assert (name, hf_name) == ("run", "hf") and type(hf_model) is type(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf_model(ids).logits)
    text = "déf f(x): return x"
    assert hf_tokenizer.encode(text) == tokenizer.encode(text)
    assert all(hf_tokenizer.token_bytes(i) == tokenizer.token_bytes(i) for i in range(256))


def test_a_preset_and_bad_sources():
    model, tokenizer, name = load_for_serving(preset="tiny", **CPU)
    assert name == "tiny-random" and tokenizer.vocab_size == model.config.vocab_size == 256
    with pytest.raises(ValueError, match="--ckpt RUN_DIR"):
        load_for_serving(**CPU)
    with pytest.raises(ValueError, match="--ckpt RUN_DIR"):
        load_for_serving(ckpt="x", preset="tiny", **CPU)
