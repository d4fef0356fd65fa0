"""The synthetic training path learns: a tiny all-MLA model reaches 90% answer accuracy on MQAR at length 32 on the
CPU, trained and evaluated by `synth.run.train_run` (the `hybrid-attention synth` code), sized for the two CPU cores
of a small CI machine.

The configuration (docs/fidelity.md, "The CPU learning check"): 2 MLA layers of 2 heads of 32 (hidden 64), MQAR
with 4 key-value pairs and every key queried, keys and values each from 32 symbols; Muon for the hidden matrices,
learning rate 2e-2, batch 64, 500 steps. The accuracy is measured on 8 batches of the evaluation stream, which
training never sees (2048 answers; chance is 1/32).
"""

import torch

from hybrid_attention.synth.run import RunSpec, Settings, train_run
from hybrid_attention.synth.tasks import Task


def test_tiny_mla_learns_mqar_at_length_32():
    spec = RunSpec("mqar", 32, "mla", lr=2e-2, steps=500)
    settings = Settings(batch_size=64, num_symbols=32, mqar_queries=4, seed=0, eval_every=250, eval_batches=8,
                        num_layers=2, num_heads=2, head_dim=32, optimizer="muon")  # fmt: skip
    assert Task("mqar", 32, 32, 4).num_pairs == 4  # every key of the context is queried
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))  # the cores the check is sized for (one core computes the same bits)
    try:
        row = train_run(spec, settings, device=torch.device("cpu"), dtype="float32")
    finally:
        torch.set_num_threads(threads)
    assert row["step"] == 500 and not row["diverged"]
    assert row["accuracy"] >= 0.9, f"answer accuracy {row['accuracy']:.3f} after 500 steps (loss {row['loss']:.3f})"
