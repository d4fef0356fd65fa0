"""What a training run reports and when (hybrid_attention/training/report.py): validation schedule, epochs, memory."""

from __future__ import annotations

from hybrid_attention.training.config import TrainConfig
from hybrid_attention.training.loop import train
from hybrid_attention.training.report import (
    epoch_report,
    epochs,
    is_validation_step,
    memory_line,
    validation_interval,
    validation_line,
)


def _schedule(steps, every):
    return [s for s in range(1, steps + 1) if is_validation_step(s, steps, every)]


def test_validation_schedule_starts_at_step_1_and_runs_every_tenth_of_the_run():
    assert _schedule(360, None) == [1, *range(36, 361, 36)]
    assert _schedule(250, None) == [1, *range(25, 251, 25)]
    assert _schedule(103, None) == [1, *range(10, 101, 10), 103]  # the last step always validates
    assert _schedule(7, None) == list(range(1, 8))  # short runs: every step
    assert _schedule(20, 7) == [1, 7, 14, 20]
    assert _schedule(1, None) == [1]
    assert validation_interval(360, None) == 36 and validation_interval(360, 50) == 50


def test_epochs_and_the_warning_past_one_epoch():
    assert epochs(360, 32768, 75_000_000) == 0.1572864 and epochs(10, 100, 1000) == 1.0  # 11,796,480 / 75e6
    line, warning = epoch_report(360, 32768, 75_000_000)
    assert warning is None and "0.16 epochs of the 75,000,000-token training split" in line
    assert "11,796,480 tokens" in line
    line, warning = epoch_report(300, 32768, 2_500_000)
    assert "3.93 epochs" in line
    assert warning.startswith("warning: --steps 300 reads the training split 3.9 times") and "memorise" in warning
    assert epoch_report(10, 100, 1000)[1] is None  # exactly one epoch is fine


def test_epoch_warning_is_printed_before_training(tmp_path):
    for i in range(40):
        (tmp_path / "data" / f"doc{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "data" / f"doc{i}.txt").write_text(f"line {i} of a small corpus\n" * 2)
    lines = []
    config = TrainConfig.create(
        data=str(tmp_path / "data"), steps=100, stop_after=1, batch_size=2, seq_len=32, eval_batches=1,
        out=str(tmp_path / "run"), device="cpu",
    )  # fmt: skip
    summary = train(config, echo=lines.append)
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning: --steps 100 reads the training"))
    assert warning < next(i for i, line in enumerate(lines) if line.startswith("model:"))
    assert summary["step"] == 1 and summary["val_loss"] is not None and summary["train_eval_loss"] is not None


def test_report_lines():
    line = validation_line(40, 3.25, 3.5, 1.2345, 6.86)
    assert line == (
        "step 40: train windows 3.2500, validation 3.5000 nats/token (1.234 bits/byte), gap +0.2500; "
        "unigram baseline 6.8600"
    )
    memory = {"allocated": 21 * 2**30, "reserved": 24 * 2**30, "total": 80 * 2**30}
    assert memory_line("NVIDIA A100", memory) == (
        "NVIDIA A100: peak memory 21.0 GiB allocated, 24.0 GiB reserved, 30% of the card's 80.0 GiB"
    )
