"""A run directory never loses work: training jobs killed with SIGKILL at many points (inside file writes too), or
stopped with SIGINT, resume to the same losses and weights as an uninterrupted run.

The jobs run in child processes forked from a server that has already imported torch (a fresh interpreter per kill
would cost seconds each). A hook in the child wraps every write of the run directory; at the chosen point it tells
the test and waits, and the test kills it (or signals it and lets it go on).
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid_attention import cli
from hybrid_attention.runs import checkpoint as ckpt
from tests.helpers import FORKSERVER_PRELOAD

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL, flock and forkserver: Linux")

STEPS = 10
ARGS = ["--steps", STEPS, "--batch-size", 2, "--seq-len", 32, "--eval-every", 2, "--eval-batches", 1, "--log-every", 1]
TIMEOUT = 120  # seconds a child may take to reach its point (a loaded CI machine imports torch slowly)


def _corpus(path: Path) -> Path:
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    return path


# ------------------------------------------------------------------------------------------------ the child side
def _hooked_main(argv: list[str], kill_at: tuple | None, conn) -> None:
    """`hybrid-attention *argv` with every run-directory write wrapped. At the event `kill_at` = (name, phase, n),
    the n-th time it happens, report it on `conn` and wait for the test; "written" events tear the file first."""
    from hybrid_attention.runs import checkpoint as ckpt  # the child's own modules

    counts = collections.Counter()

    def event(name, phase, torn=None):
        counts[name, phase] += 1
        if (name, phase, counts[name, phase]) != kill_at:
            return
        if torn is not None:
            torn()
        conn.send((name, phase))
        conn.recv()  # the test kills this process here, or signals it and lets it go on

    def tear(path):
        return lambda: os.truncate(path, os.path.getsize(path) // 2)

    def wrap(name, real, target=lambda *a: None):
        def hooked(*args, **kwargs):
            label = name(*args) if callable(name) else name
            event(label, "before")
            result = real(*args, **kwargs)
            event(label, "written" if target(*args) else "after", torn=target(*args))
            return result

        return hooked

    def append_log(run_dir, row):
        path, line = Path(run_dir) / ckpt.LOG, json.dumps(row) + "\n"
        event("log", "before")
        with open(path, "a") as f:
            f.write(line)
        event("log", "written", torn=lambda: os.truncate(path, path.stat().st_size - len(line) // 2))

    os.rename = wrap("rename", os.rename)
    os.replace = wrap(lambda src, dst: f"replace:{Path(dst).name}", os.replace)
    shutil.rmtree = wrap(lambda p, *a: "rmtree:" + ("tmp" if str(p).endswith(".tmp") else "checkpoint"), shutil.rmtree)
    ckpt.save_model = wrap("weights", ckpt.save_model, lambda model, path, *a: tear(path))
    torch.save = wrap("state", torch.save, lambda obj, path, *a: tear(path))
    ckpt.append_log = append_log
    code = cli.main([str(a) for a in argv])
    conn.send(("exit", code))


# ------------------------------------------------------------------------------------------------- the test side
@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, __name__])
    return ctx


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(data file, run directory) of an uninterrupted run."""
    root = tmp_path_factory.mktemp("crash")
    data = _corpus(root / "data.txt")
    assert cli.main([str(a) for a in ["train", "--out", root / "reference", "--data", data, *ARGS]]) == 0
    return data, root / "reference"


class Job:
    """A hooked `hybrid-attention` child process, stopped at its point."""

    def __init__(self, ctx, argv, kill_at):
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_hooked_main, args=(argv, kill_at, child_end), daemon=True)
        self.process.start()
        self.point = kill_at
        self.reached = self.receive()

    def receive(self):
        if not self.conn.poll(TIMEOUT):
            self.process.kill()
            raise AssertionError(f"the job did not reach {self.point} within {TIMEOUT} s")
        return self.conn.recv()

    def kill(self) -> None:
        assert self.reached == self.point[:2], f"the job ended ({self.reached}) before reaching {self.point}"
        self.process.kill()  # SIGKILL
        self.process.join(TIMEOUT)
        assert self.process.exitcode == -signal.SIGKILL


def _losses(run_dir):
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in ckpt.read_log(run_dir)}


def _weights(run_dir):
    return load_file(ckpt.latest_checkpoint(run_dir) / ckpt.WEIGHTS)


def assert_same_as_reference(run_dir, reference_dir):
    assert _losses(run_dir) == _losses(reference_dir)  # bitwise: same batches, optimizer and RNG states
    a, b = _weights(run_dir), _weights(reference_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(os.listdir(run_dir / ckpt.CHECKPOINTS)) == [ckpt.LATEST, ckpt.step_dir_name(STEPS)]
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]


# Each kill is followed by a `--resume` job, killed at the next point; the comment says what the run holds then.
# Checkpoints come every 2 steps. Until the first pointer exists, a resume takes the newest whole step directory.
CHAIN = [
    ("weights", "written", 1),  # a torn weights file in the first checkpoint's temporary directory
    ("state", "before", 1),  # the weights written, the training state not yet
    ("rename", "after", 1),  # step_2 renamed into place, no pointer yet: the resume recovers step 2
    ("replace:latest", "before", 1),  # step_4 in place, its pointer written to a temporary file: recovered too
    ("replace:latest", "after", 1),  # resumed from 4: step 6 committed, step_4 not yet removed
    ("state", "written", 1),  # resumed from 6: a torn training state in step 8's temporary directory
    ("rename", "after", 1),  # step_8 in place, not committed: the pointer (step 6) wins
    ("rmtree:checkpoint", "before", 2),  # step 8 committed (over the uncommitted step_8), step_6 not yet removed
    ("replace:log.jsonl", "before", 1),  # resumed from 8: the log rewrite, interrupted
    ("log", "written", 1),  # a torn log line at step 9
    ("replace:latest", "before", 1),  # step 10 written and renamed, not committed
]


def test_sigkill_at_every_write_then_resume_matches_an_uninterrupted_run(forkserver, reference, tmp_path):
    data, reference_dir = reference
    run = tmp_path / "run"
    argv = ["train", "--out", run, "--data", data, *ARGS]
    for point in CHAIN:
        Job(forkserver, argv, point).kill()
        directory = ckpt.latest_checkpoint(run)  # None, or a whole checkpoint
        if directory is not None:
            assert ckpt.weights_step(directory) == ckpt.load_train_state(directory)["step"]
        argv = ["train", "--resume", "--out", run]
    assert cli.main([str(a) for a in argv]) == 0
    assert_same_as_reference(run, reference_dir)


def test_sigint_saves_and_a_second_one_aborts(forkserver, reference, tmp_path, capsys):
    data, reference_dir = reference
    run = tmp_path / "run"
    job = Job(forkserver, ["train", "--out", run, "--data", data, *ARGS], ("log", "before", 3))
    os.kill(job.process.pid, signal.SIGINT)
    job.conn.send("go on")
    assert job.receive() == ("exit", 130)  # saved after step 3 (not a checkpoint step) and stopped
    assert ckpt.checkpoint_step(run) == 3 and [r["step"] for r in ckpt.read_log(run)] == [1, 2, 3]
    job = Job(forkserver, ["train", "--resume", "--out", run], ("log", "before", 1))
    os.kill(job.process.pid, signal.SIGTERM)
    os.kill(job.process.pid, signal.SIGINT)  # the second request aborts at once
    job.conn.send("go on")
    assert job.receive() == ("exit", 130)
    assert ckpt.checkpoint_step(run) == 3
    assert cli.main([str(a) for a in ["train", "--resume", "--out", run]]) == 0
    assert_same_as_reference(run, reference_dir)
