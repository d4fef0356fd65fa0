"""Helpers of the server tests (CPU and GPU): a run directory with random weights, and `hybrid-attention serve` in a
process of its own on 127.0.0.1 and a free port, with an optional fault planted for one prompt."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tests.helpers import checkout_env

FAULT_PROMPT = [0, 33, 33, 70]  # "\x00!!F": a prompt that starts with these fails inside the engine (LAUNCHER)
LAUNCHER = """
import sys
from hybrid_attention.inference.engine import Engine

real, real_packed = Engine.prefill_chunk, Engine.prefill_packed

def prefill_chunk(self, request, slot, start, end):  # a fault planted by the tests, for one prompt only
    if request.prompt[:4] == FAULT_PROMPT:
        raise RuntimeError("planted fault")
    return real(self, request, slot, start, end)

def prefill_packed(self, chunks):  # new prompts packed together: the fault fails the forward, each then runs alone
    if any(chunk.seq.owner.prompt[:4] == FAULT_PROMPT for chunk in chunks):
        raise RuntimeError("planted fault")
    return real_packed(self, chunks)

Engine.prefill_chunk, Engine.prefill_packed = prefill_chunk, prefill_packed
from hybrid_attention.cli import main
sys.exit(main(sys.argv[1:]))
""".replace("FAULT_PROMPT", repr(FAULT_PROMPT))


def write_run(out: Path, *, preset: str = "tiny", seed: int = 0, head_scale: float = 30.0) -> Path:
    """A run directory holding random weights of `preset` (byte vocabulary), its head scaled so that greedy tokens
    are far from ties (batching changes the rounding of the logits, never their order)."""
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.data.tokenizer import ByteTokenizer
    from hybrid_attention.model import HybridLM
    from hybrid_attention.training.model_run import save_model_run

    torch.manual_seed(seed)
    model = HybridLM(HybridConfig.from_preset(preset, vocab_size=256))
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return save_model_run(out, model, ByteTokenizer())


class Server:
    """`hybrid-attention serve ARGS --port 0` in a new process (through LAUNCHER); `url` once it is ready."""

    def __init__(self, args: list[str], *, timeout: float = 120.0):
        env = checkout_env(PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-c", LAUNCHER, "serve", *map(str, args), "--host", "127.0.0.1", "--port", "0"]
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        ready = threading.Event()
        self.port = None

        def read() -> None:
            for line in self.process.stderr:
                self.lines.append(line)
                found = re.search(r"ready at http://127\.0\.0\.1:(\d+)/v1", line)
                if found:
                    self.port = int(found.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text, e.g. metric(text, 'hybrid_attention_cache_pages_in_use')."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(condition, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
