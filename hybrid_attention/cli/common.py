"""What the commands share: flag types and groups, device choice, wording (torch-free at import)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid_attention.choices import ATTNRES_BACKENDS, KDA_BACKENDS


def data_spec(text: str) -> str:
    """Local paths are stored absolute, so a resumed run finds its data from any directory."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path or hf:NAME, got an empty string")
    if text.startswith("hf:") or text in ("builtin", "python-env"):
        return text
    path = Path(text).expanduser().resolve()
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise argparse.ArgumentTypeError(f"{text} is neither a regular file nor a directory")
    return str(path)


def add_backend_flags(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """Which kernels run: chosen when a model is loaded, never stored with it."""
    parser.add_argument("--kda-backend", choices=KDA_BACKENDS, default=default, help="chunk_kda backend (default auto)")
    parser.add_argument(
        "--attnres-backend",
        choices=ATTNRES_BACKENDS,
        default=default,
        help="AttnRes: auto (fused Triton ops on CUDA), triton, or torch (the reference)",
    )


def device_and_dtype(args):
    from hybrid_attention.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    say_when_compiling(device)
    return device, resolve_dtype(device, args.dtype)


def say_when_compiling(device) -> None:
    """On CUDA, a line on stderr whenever a Triton kernel compiles (the first run on a machine) instead of silence."""
    if device.type != "cuda":
        return
    from tqdm import tqdm

    from hybrid_attention.ops.triton_support import triton_available

    if triton_available():
        from hybrid_attention.ops.triton_cache import announce_compilation

        announce_compilation(lambda line: tqdm.write(line, file=sys.stderr))


def backends(args) -> dict:
    return {"kda_backend": args.kda_backend, "attnres_backend": args.attnres_backend}


def plural(n: int, noun: str) -> str:
    """'1 MLA layer', '3 MLA layers', '1,024 windows'."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
