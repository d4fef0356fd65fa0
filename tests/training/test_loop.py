"""Training: schedule, optimizer split, FLOPs, evaluation, checkpoints and exact resume (training/loop.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hybrid_attention import files
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import manifest, run_config
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.loop import train
from hybrid_attention.training.metrics import evaluate, flops_per_token, peak_flops
from hybrid_attention.training.optim import build_optimizers, build_schedulers, lr_factor, param_groups

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
SMALL = dict(steps=6, batch_size=2, seq_len=32, eval_every=3, eval_batches=2, log_every=1, data_max_bytes=40_000)


def _tiny_model(**overrides) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.from_preset("tiny", **overrides))


@needs_muon
def test_lr_schedule_warmup_then_cosine_to_min_ratio():
    f = lambda s: lr_factor(s, warmup=4, steps=20, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and abs(f(12) - 0.55) < 1e-12 and abs(f(20) - 0.1) < 1e-12 and abs(f(25) - 0.1) < 1e-12
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
    optimizers = build_optimizers(_tiny_model(), optimizer="muon", lr=0.01, weight_decay=0.1)
    schedulers = build_schedulers(optimizers, warmup=4, steps=20, min_ratio=0.1)
    for step in range(20):
        for opt in optimizers:
            assert all(abs(g["lr"] - 0.01 * f(step)) < 1e-15 for g in opt.param_groups)
            opt.step()
        for sched in schedulers:
            sched.step()


def test_param_groups_muon_gets_hidden_matrices_only():
    model = _tiny_model()
    groups, matrices = param_groups(model, 0.1, muon=True)
    decay, no_decay = groups
    names = {id(p): n for n, p in model.named_parameters()}
    everything = decay["params"] + no_decay["params"] + matrices
    assert sorted(map(id, everything)) == sorted(id(p) for p in model.parameters())  # each exactly once
    muon_names = {names[id(p)] for p in matrices}
    assert "embed.weight" not in muon_names and "lm_head.weight" not in muon_names
    assert "layers.0.mixer.q_proj.weight" in muon_names and "layers.3.mlp.down_proj.weight" in muon_names
    assert all(p.ndim == 2 and not getattr(p, "_no_weight_decay", False) for p in matrices)
    convs = {n for n, p in model.named_parameters() if p.ndim == 3}  # depthwise conv kernels [C, 1, W]: AdamW
    assert convs and {names[id(p)] for p in decay["params"]} == {"embed.weight", "lm_head.weight"} | convs
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    for p in no_decay["params"]:
        assert p.ndim < 2 or getattr(p, "_no_weight_decay", False)
    flagged = [n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False)]
    assert flagged and all(any(p is q for q in no_decay["params"]) for n, p in model.named_parameters() if n in flagged)
    assert any(n.endswith("A_log") for n in flagged) and any(n.endswith("dt_bias") for n in flagged)
    adamw_groups, none = param_groups(model, 0.1, muon=False)
    assert none == [] and sum(len(g["params"]) for g in adamw_groups) == len(list(model.parameters()))


def test_muon_missing_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    with pytest.raises(ValueError, match=r"--optimizer muon needs torch.optim.Muon \(torch >= 2.9\)"):
        build_optimizers(_tiny_model(), optimizer="muon", lr=1e-3, weight_decay=0.1)


def test_a_torch_without_muon_imports_everything_else():
    """torch < 2.9 has no torch.optim.Muon: every module imports, AdamW trains, and only --optimizer muon is refused
    (in a fresh interpreter where Muon is gone before the package is imported)."""
    code = """
import torch
del torch.optim.Muon
import hybrid_attention.cli, hybrid_attention.training.distributed
import hybrid_attention.training.loop, hybrid_attention.training.step
import hybrid_attention.synth.run
from hybrid_attention.model import HybridConfig, HybridLM
from hybrid_attention.training.optim import build_optimizers
model = HybridLM(HybridConfig.from_preset("tiny"))
assert len(build_optimizers(model, optimizer="adamw", lr=1e-3, weight_decay=0.1)) == 1
try:
    build_optimizers(model, optimizer="muon", lr=1e-3, weight_decay=0.1)
except ValueError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--optimizer muon needs torch.optim.Muon (torch >= 2.9)" in out.stdout, out.stdout


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match=r"optimizer must be one of \('adamw', 'muon'\), got 'sgd'"):
        build_optimizers(_tiny_model(), optimizer="sgd", lr=1e-3, weight_decay=0.1)


def test_peak_flops_lookup_by_device_name():
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H20") == 148e12  # not mistaken for an H200 or the reverse
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None and peak_flops("Some Future GPU") is None


def test_flops_per_token_by_hand():
    model = _tiny_model()
    c = model.config
    n = model.num_parameters() - c.vocab_size * c.hidden_size  # the embedding is a lookup
    mla = 1 * 2 * 2 * (16 + 16 + 32) * 100 / 2  # one MLA layer, 2 heads, d_qk 32, d_v 32, T = 100
    kda = 3 * 2 * (6 * 32 * 32 + 3 * 64 * 32 + 64 * 64)  # three KDA layers, 2 heads of 32, chunk 64
    assert flops_per_token(model, 100) == 6 * n + 3 * (mla + kda)


def test_evaluate_matches_direct_cross_entropy_and_bits_per_byte():
    model = _tiny_model().eval()
    tokens = torch.randint(0, 256, (700,), generator=torch.Generator().manual_seed(1))
    loss, bpb = evaluate(
        model, tokens, torch.ones(256, dtype=torch.long), batch_size=3, seq_len=50, num_batches=None,
        autocast=lambda: torch.autocast("cpu", enabled=False),
    )  # fmt: skip
    windows = tokens[: 14 * 50].view(14, 50).long()
    with torch.no_grad():
        logits = model(windows).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
    assert abs(loss - ref.item()) < 1e-5 * ref.item()
    assert abs(bpb - loss / math.log(2)) < 1e-12  # one byte per token


def _run(tmp_path, name, **overrides):
    config = TrainConfig.create(out=str(tmp_path / name), **{**SMALL, **overrides})
    return train(config, echo=lambda *a: None)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in ckpt.read_log(run_dir)}


@pytest.mark.parametrize(
    "options",
    [dict(), pytest.param(dict(optimizer="muon", grad_accum=2), marks=needs_muon)],
    ids=["adamw", "muon-accum2"],
)
def test_resume_is_exact(tmp_path, options):
    full = _run(tmp_path, "full", **options)
    first = _run(tmp_path, "split", stop_after=3, **options)
    assert first["step"] == 3 and full["step"] == 6
    saved = run_config.load_config(tmp_path / "split")["train"]
    second = train(TrainConfig.create(saved, out=str(tmp_path / "split")), resume=True, echo=lambda *a: None)
    assert second["step"] == 6
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in a.values())
    assert a == b  # bitwise: same data, same optimizer states, same schedule
    wa, wb = (load_file(ckpt.latest_checkpoint(tmp_path / name) / ckpt.WEIGHTS) for name in ("full", "split"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert full["val_loss"] == second["val_loss"]


def test_run_directory_contents(tmp_path):
    summary = _run(tmp_path, "run", steps=4, eval_every=2, log_every=3)
    run = tmp_path / "run"
    for name in ("config.json", "log.jsonl", "loss.png", "summary.json", "lock", "checkpoints/latest"):
        assert (run / name).is_file(), name
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000004"]  # the step-2 one is removed
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004\n"
    assert sorted(os.listdir(run / "checkpoints" / "step_00000004")) == [
        "checkpoint.json",
        "model.safetensors",
        "train_state.pt",
    ]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = ckpt.read_log(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # evaluations (step 1 always), log_every and the final step
    assert all({"step", "loss", "tokens_per_s"} <= r.keys() for r in rows) and "val_loss" in rows[-1]
    config = run_config.load_config(run)
    assert HybridConfig.from_dict(config["model"]) == HybridConfig.from_preset("tiny")
    assert config["train"]["steps"] == 4 and config["tokenizer"] == {"kind": "byte", "vocab_size": 256, "eod_id": 255}
    latest = ckpt.latest_checkpoint(run)
    assert ckpt.load_train_state(latest)["step"] == 4 and ckpt.weights_step(latest) == 4
    assert summary["val_loss"] == rows[-1]["val_loss"] and summary["unigram_loss"] > 0
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]
    umask = os.umask(0o022)
    os.umask(umask)
    files = [p for p in run.rglob("*") if p.is_file()]
    assert {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~umask}, "one rule for every file's permissions"


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    _run(tmp_path, "run", steps=2, eval_every=2)
    run = tmp_path / "run"
    before = snapshot(run / "checkpoints")

    def dies_halfway(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)  # the second file of the checkpoint
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_training(run, _tiny_model(), [], [], 99)
    assert snapshot(run / "checkpoints") == before


def snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_resume_refuses_weights_and_state_from_different_steps(tmp_path):
    _run(tmp_path, "run", stop_after=3)
    run = tmp_path / "run"
    latest = ckpt.latest_checkpoint(run)
    ckpt.save_train_state(latest, {**ckpt.load_train_state(latest), "step": 2})
    manifest.write_manifest(latest, kind="single", step=3)  # recorded as written: the step check must refuse it
    with pytest.raises(ValueError, match=r"weights \(step 3\) and train_state.pt \(step 2\) disagree; the checkpoint"):
        train(TrainConfig.create(run_config.load_config(run)["train"]), resume=True)


def test_resume_drops_log_lines_after_the_checkpoint(tmp_path):
    _run(tmp_path, "run", stop_after=3)
    run = tmp_path / "run"
    with open(run / ckpt.LOG, "a") as f:
        f.write(json.dumps({"step": 4, "loss": 123.0, "tokens_per_s": 1.0}) + "\n" + '{"step": 5, "lo')
    train(TrainConfig.create(run_config.load_config(run)["train"], out=str(run)), resume=True, echo=lambda *a: None)
    rows = ckpt.read_log(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[3]["loss"] != 123.0


def test_weights_from_another_config_are_refused(tmp_path):
    ckpt.save_weights(tmp_path, _tiny_model(), 1)
    with pytest.raises(ValueError, match=r"does not match the model in config.json: .*\(256, 64\) vs \(256, 48\)"):
        ckpt.load_weights(tmp_path, _tiny_model(hidden_size=48))
    with pytest.raises(ValueError, match=r"does not match the model in config.json: missing tensors \['layers.4"):
        ckpt.load_weights(tmp_path, _tiny_model(layer_types=("kda", "kda", "kda", "mla", "mla")))


def test_atomic_write_replaces_with_default_permissions_and_leaves_no_temporary(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    target = tmp_path / "f.txt"
    files.atomic_write_text(target, "old")
    files.atomic_write_text(target, "new")
    assert target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(RuntimeError, match="boom"):
        files.atomic_write(target, lambda tmp: (_ for _ in ()).throw(RuntimeError("boom")))
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    """--compile wraps the model in torch.compile; traced by dynamo + AOT autograd (the "aot_eager" backend, so CI
    skips inductor's minutes of code generation), the losses match the eager run."""
    real_compile, calls = torch.compile, []

    def compile_for_test(model, **kwargs):
        calls.append(model)
        return real_compile(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_for_test)
    _run(tmp_path, "eager", steps=3)
    _run(tmp_path, "compiled", steps=3, compile=True)
    assert len(calls) == 1
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert sorted(eager) == sorted(compiled) == [1, 2, 3]
    for step in eager:
        assert abs(eager[step] - compiled[step]) < 1e-4 * abs(eager[step]), (step, eager[step], compiled[step])
