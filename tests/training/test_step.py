"""The training step (hybrid_attention/training/step.py) on the CPU: the eager step is the plain loop, bitwise; the
CUDA-graph option is refused clearly where it cannot run; --cuda-graph may change on --resume.

The graphed step itself needs CUDA: tests/gpu/training/test_step_gpu.py compares it with the eager step.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybrid_attention import cli
from hybrid_attention.config import HybridConfig
from hybrid_attention.model import HybridLM
from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import run_config
from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.loop import train
from hybrid_attention.training.optim import build_optimizers, build_schedulers
from hybrid_attention.training.step import TrainStep, _Snapshot

SMALL = dict(steps=4, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, log_every=1, data_max_bytes=20_000)


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = HybridLM(HybridConfig.from_preset("tiny"))
    optimizers = build_optimizers(model, optimizer="adamw", lr=3e-3, weight_decay=0.1)
    schedulers = build_schedulers(optimizers, warmup=1, steps=3, min_ratio=0.1)
    return model, optimizers, schedulers


def _batches(steps: int, grad_accum: int, B: int = 2, T: int = 11):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (grad_accum, B, T), generator=gen) for _ in range(steps)]


def test_eager_step_is_the_plain_loop_bitwise():
    """Three steps of two micro-batches with clipping and a schedule: losses, norms and parameters equal a loop
    written out by hand, bitwise (float32, CPU)."""
    batches, clip = _batches(3, 2), 0.5  # a clip the norms exceed, so clipping changes the update
    model, optimizers, schedulers = _setup()
    params = list(model.parameters())
    expected = []
    for step_batches in batches:
        loss_sum = torch.zeros(())
        for x in step_batches:
            loss = model(x, labels=x, return_logits=False).loss / 2
            loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        for opt in optimizers:
            opt.step()
        for sched in schedulers:
            sched.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        expected.append((loss_sum, norm))
    reference = [p.detach().clone() for p in params]

    model, optimizers, schedulers = _setup()
    loss_of = lambda ids: model(ids, labels=ids, return_logits=False).loss  # noqa: E731
    step = TrainStep(loss_of, model.parameters(), optimizers, grad_accum=2, clip=clip)
    for step_batches, (loss_ref, norm_ref) in zip(batches, expected, strict=True):
        loss_sum, norm = step.step(step_batches)
        for sched in schedulers:
            sched.step()
        assert torch.equal(loss_sum, loss_ref) and torch.equal(norm, norm_ref)
        assert norm > clip and all(p.grad is None for p in model.parameters())
        assert not loss_sum.requires_grad and not norm.requires_grad
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True))


@pytest.mark.parametrize("before", [0, 1], ids=["fresh-optimizer", "after-one-step"])
def test_snapshot_undoes_the_warmup_steps(before):
    """What capture relies on (CUDA graphs warm up with real steps): after steps taken past a snapshot and its
    restore, the next step is the one a run without those steps takes, bitwise. With a fresh optimizer the state
    the warm-up creates goes back to zeros (Adam's fresh state)."""
    batches = _batches(before + 1 + 2, 1)
    runs = []
    for warm_up in (False, True):
        model, optimizers, _ = _setup()
        loss_of = lambda ids, model=model: model(ids, labels=ids, return_logits=False).loss  # noqa: E731
        step = TrainStep(loss_of, model.parameters(), optimizers, clip=1.0)
        for batch in batches[:before]:
            step.step(batch)
        if warm_up:
            saved = _Snapshot(step.params, optimizers)
            for batch in batches[before + 1 :]:
                step.step(batch)
            assert not all(torch.equal(p, c) for p, (_, c) in zip(model.parameters(), saved.tensors, strict=False))
            saved.restore()
        loss, norm = step.step(batches[before])
        state = [t.clone() for opt in optimizers for s in opt.state.values() for t in s.values()]
        runs.append((loss, norm, [p.detach().clone() for p in model.parameters()], state))
    (loss_a, norm_a, params_a, state_a), (loss_b, norm_b, params_b, state_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(norm_a, norm_b) and len(state_a) == len(state_b) > 0
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state_a, state_b, strict=True))


def test_clip_none_skips_the_norm_and_inf_measures_it():
    model, optimizers, _ = _setup()
    loss_of = lambda ids: model(ids, labels=ids, return_logits=False).loss  # noqa: E731
    (batch,) = _batches(1, 1)
    assert TrainStep(loss_of, model.parameters(), optimizers).step(batch)[1] is None
    norm = TrainStep(loss_of, model.parameters(), optimizers, clip=math.inf).step(batch)[1]
    assert math.isfinite(float(norm)) and float(norm) > 0


def test_bad_arguments_are_clear_errors():
    model, optimizers, _ = _setup()
    loss_of = lambda ids: model(ids, labels=ids, return_logits=False).loss  # noqa: E731
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"cuda_graph=True needs parameters on a CUDA device, got cpu"):
        TrainStep(loss_of, params, optimizers, cuda_graph=True)
    sgd = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match=r"supports torch.optim.Adam, AdamW and StackedMuon only, got SGD"):
        TrainStep(loss_of, params, [sgd], cuda_graph=True)
    with pytest.raises(ValueError, match=r"grad_accum must be a positive integer, got 0"):
        TrainStep(loss_of, params, optimizers, grad_accum=0)
    with pytest.raises(ValueError, match=r"clip must be >= 0"):
        TrainStep(loss_of, params, optimizers, clip=-1.0)
    with pytest.raises(ValueError, match=r"at least one parameter"):
        TrainStep(loss_of, [], optimizers)
    step = TrainStep(loss_of, params, optimizers, grad_accum=2)
    with pytest.raises(ValueError, match=r"expected batches \[grad_accum=2, \.\.\.\], got \(1, 2, 11\)"):
        step.step(_batches(1, 1)[0])


def test_cuda_graph_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--cuda-graph needs a CUDA device, got cpu \(--device cpu\)"):
        train(TrainConfig.create(out=str(out), device="cpu", cuda_graph=True, **SMALL), echo=lambda *a: None)
    assert not out.exists()
    assert TrainConfig.create(out=str(out), optimizer="muon", cuda_graph=True).cuda_graph  # StackedMuon is captured
    code = cli.main(["train", "--cuda-graph", "--device", "cpu", "--out", str(out), "--steps", "2"])
    assert code == 1 and "--cuda-graph needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_cuda_graph_may_change_on_resume(tmp_path, capsys):
    """A speed option: a resumed run may turn it on or off (the checkpoint is the same either way); a config.json
    written before it existed still loads."""
    out = tmp_path / "run"
    first = train(TrainConfig.create(out=str(out), device="cpu", stop_after=2, **SMALL), echo=lambda *a: None)
    assert first["step"] == 2
    config = json.loads((out / run_config.CONFIG).read_text())
    assert config["train"]["cuda_graph"] is False
    config["train"]["cuda_graph"] = True  # as a run started with --cuda-graph on a GPU
    (out / run_config.CONFIG).write_text(json.dumps(config))
    assert cli.main(["train", "--resume", "--out", str(out)]) == 1  # it keeps the setting: no CUDA here
    assert "--cuda-graph needs a CUDA device" in capsys.readouterr().err
    assert cli.main(["train", "--resume", "--out", str(out), "--no-cuda-graph", "--stop-after", "3"]) == 0
    assert ckpt.checkpoint_step(out) == 3
    saved = ckpt.load_config(out)["train"]
    del saved["cuda_graph"]  # an older run's settings
    resumed = train(TrainConfig.create(saved, out=str(out)), resume=True, echo=lambda *a: None)
    assert resumed["step"] == 4 and not TrainConfig.create(saved, out=str(out)).cuda_graph
