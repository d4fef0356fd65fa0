"""What every benchmark script records about its run (imported by the scripts in this folder)."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    """Progress to stderr, so stdout keeps the table and the final JSON line."""
    print(msg, file=sys.stderr, flush=True)


def checkout_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that imports this checkout first, then what PYTHONPATH already holds
    (packages installed with `pip install --target`, say); `extra` sets more variables."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def env_info(argv) -> dict:
    """Date, GPU, torch / triton / fla versions (None when absent) and the exact command."""
    info = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        command="python " + " ".join(argv),
    )
    for name in ("triton", "fla"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    return info


def emit_json(result: dict, out: str | None) -> None:
    """The result as one JSON line on stdout (last, after the tables), and also into `out` when given."""
    line = json.dumps(result, default=str)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
    print(line)
