"""What autograd keeps for the backward of one training step, per module: bytes per token and the largest tensors.

Every tensor saved for the backward (by a built-in op or by a custom autograd Function) passes through a
`torch.autograd.graph.saved_tensors_hooks` pack hook; forward hooks on every module say which module was running.
Each storage counts once (its whole size: a saved view keeps the storage alive), parameters not at all. Bytes per
token come from two sequence lengths, (bytes(T2) - bytes(T1)) / (B (T2 - T1)), so what does not grow with T (autocast
copies of the weights) drops out and what grows faster than T (attention scores) shows as a larger slope.

    python benchmarks/saved_bytes.py --preset k3-scaled --residual standard --seq-len 64 128 --autocast bf16
    python benchmarks/saved_bytes.py --preset k3-scaled --seq-len 1024 2048 --device cuda

On CPU the layers run their PyTorch references (KDA's chunked reference, eager norms and convs), on CUDA their Triton
kernels, so the two audits differ where the kernels save less. Table on stdout, JSON as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_common import emit_json  # noqa: E402
from hybrid_attention.choices import RESIDUALS  # noqa: E402
from hybrid_attention.config import HybridConfig  # noqa: E402
from hybrid_attention.model import HybridLM


@dataclass
class Saved:
    module: str  # qualified name of the innermost module running when it was saved ("" = the model's own code)
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # of the whole storage


def saved_tensors(model: nn.Module, step: Callable[[], torch.Tensor]) -> tuple[list[Saved], torch.Tensor]:
    """Run `step()` (a forward that returns the loss) and list every distinct storage saved for its backward.

    Returns (the saved storages, the loss); the graph is still alive, so the caller may run the backward."""
    names = {m: name for name, m in model.named_modules()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack = [""]
    seen: set[int] = set()
    found: list[Saved] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen and storage.nbytes() > 0:
            seen.add(key)
            found.append(Saved(stack[-1], tuple(t.shape), t.dtype, storage.nbytes()))
        return t

    def enter(module, args) -> None:
        stack.append(names[module])

    def leave(module, args, out) -> None:  # returns None: a hook's return value would replace the output
        stack.pop()

    hooks = []
    for module in names:
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
    finally:
        for h in hooks:
            h.remove()
    return found, loss


def group_of(module: str, depth: int) -> str:
    """'layers.3.mixer.q_proj' -> 'layers.3' (depth 2) or 'layers.3.mixer' (depth 3); '' -> 'model'."""
    if not module:
        return "model"
    parts = module.split(".")
    keep = depth if parts[0] == "layers" else depth - 1
    return ".".join(parts[:keep])


def bytes_by_group(saved: list[Saved], depth: int) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for s in saved:
        out[group_of(s.module, depth)] += s.nbytes
    return dict(out)


def per_token_bytes(
    model: HybridLM, *, batch: int, seq_lens: tuple[int, int], depth: int = 2, autocast: torch.dtype | None = None
) -> tuple[dict[str, float], list[Saved]]:
    """Saved bytes per token by module group, the slope between the two sequence lengths (see the module docstring).

    Returns (group -> bytes per token, the saved storages of the longer run)."""
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    runs = []
    for T in seq_lens:
        ids = torch.randint(0, model.config.vocab_size, (batch, T), device=device)
        with amp:
            saved, loss = saved_tensors(model, lambda ids=ids: model(ids, labels=ids, return_logits=False).loss)
        del loss  # frees the graph and the saved tensors before the next run
        runs.append((bytes_by_group(saved, depth), saved))
    (short, _), (long, saved) = runs
    tokens = batch * (seq_lens[1] - seq_lens[0])
    slope = {g: (long.get(g, 0) - short.get(g, 0)) / tokens for g in sorted(set(short) | set(long))}
    return slope, saved


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3-scaled")
    p.add_argument("--residual", choices=RESIDUALS, default=None, help="override the preset's residual")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, nargs=2, default=(64, 128), metavar=("T1", "T2"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--autocast", choices=("bf16", "none"), default="bf16")
    p.add_argument("--depth", type=int, default=3, help="module name depth to group by (2: per layer)")
    p.add_argument("--top", type=int, default=15, help="list this many of the largest saved tensors")
    args = p.parse_args(argv)

    overrides = {} if args.residual is None else {"residual": args.residual}
    config = HybridConfig.from_preset(args.preset, **overrides)
    torch.manual_seed(0)
    model = HybridLM(config).to(args.device).train()
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    slope, saved = per_token_bytes(model, batch=args.batch, seq_lens=tuple(args.seq_len), depth=args.depth,
                                   autocast=autocast)  # fmt: skip
    total = sum(slope.values())
    print(f"## saved for backward, bytes per token: {args.preset}, residual={config.residual}, T={args.seq_len}, "
          f"autocast={args.autocast}, {args.device}\n")  # fmt: skip
    print("| module | bytes/token | share |\n|---|---|---|")
    for g, b in sorted(slope.items(), key=lambda kv: -kv[1]):
        if b:
            print(f"| {g} | {b:,.0f} | {b / total:.1%} |")
    print(f"| total | {total:,.0f} | |\n")
    print(f"## the {args.top} largest saved storages (T = {args.seq_len[1]})\n")
    print("| module | shape | dtype | MiB |\n|---|---|---|---|")
    for s in sorted(saved, key=lambda s: -s.nbytes)[: args.top]:
        print(f"| {s.module or 'model'} | {list(s.shape)} | {str(s.dtype).removeprefix('torch.')} | "
              f"{s.nbytes / 2**20:.2f} |")  # fmt: skip
    result = dict(
        preset=args.preset,
        residual=config.residual,
        seq_len=list(args.seq_len),
        batch=args.batch,
        device=args.device,
        autocast=args.autocast,
        bytes_per_token=slope,
        total_bytes_per_token=total,
    )
    emit_json(result, None)
    return result


if __name__ == "__main__":
    main()
