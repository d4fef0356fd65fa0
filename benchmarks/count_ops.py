"""How many ops one training step (forward + backward), or one prefill chunk as the serving engine runs it
(`--prefill`), dispatches, per layer and per layer type.

A step that enqueues thousands of small kernels is bound by the host's launch rate, not by the GPU; this counts them.
Every aten op passes through a `TorchDispatchMode`; in the forward, module hooks say which module was running, and
in the backward each op is charged to the module whose forward created the autograd node that runs it (nodes are
tagged with their module when the module returns). Triton launches are counted too (they bypass the dispatcher),
and so are calls of our custom ops (their own internals are not seen, except their Triton launches).

Columns: `launch` = aten ops that start device work (views, allocations and detaches left out) + Triton launches;
`aten` = all aten ops, views included; forward (fwd) and backward (bwd). The KDA chunk op (`chunk_kda`) is its own
row and left out of the layer rows: on CPU it runs its PyTorch reference, not the kernels a GPU runs.

    python benchmarks/count_ops.py --device cpu --tiny-widths                     # the CPU (reference) path
    python benchmarks/count_ops.py --device cpu --tiny-widths --kernels triton    # the CUDA path, interpreted
    python benchmarks/count_ops.py --device cuda --batch 8 --seq-len 2048         # the real step on a GPU
    python benchmarks/count_ops.py --tiny-widths --kernels triton --prefill 512 --seq-len 512   # a serving chunk

`--kernels triton` runs on CPU what CUDA runs (the Triton kernels under the interpreter, TRITON_INTERPRET=1); slow,
so keep the widths tiny. Table on stdout, JSON as the last line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

NO_LAUNCH = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "alias",
             "lift_fresh", "_unsafe_view", "set_"}  # fmt: skip
CHUNK = "chunk_kda"


def _kind(func) -> str:
    """'custom' for our ops, 'view' for ops that start no device work, else 'aten'."""
    if func.namespace == "hybrid_attention":
        return "custom"
    if func.is_view or func._schema.name.split("::")[-1] in NO_LAUNCH:
        return "view"
    return "aten"


class OpCounter:
    """Counts ops by (phase, module name) while installed; see the module docstring."""

    def __init__(self, model):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.torch = torch
        self.model = model
        self.names = {m: name for name, m in model.named_modules()}
        self.stack = [""]
        self.phase = "fwd"
        self.counts: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (phase, module) -> kind -> count
        self.by_op: Counter = Counter()  # aten op name -> launches, whole step
        self.paused = False
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.record(func)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    # --------------------------------------------------------------------------------------------------- recording
    def where(self) -> str:
        if self.phase == "fwd":
            return self.stack[-1]
        node = self.torch._C._current_autograd_node()
        return "(backward engine)" if node is None else node.metadata.get("count_ops_module", "(untagged)")

    def record(self, func) -> None:
        if self.paused:
            return
        kind = _kind(func)
        c = self.counts[(self.phase, self.where())]
        if kind == "custom":
            c["custom"] += 1
            self.by_op[str(func.overloadpacket)] += 1
            return
        c["aten"] += 1
        if kind == "aten":
            c["launch"] += 1
            self.by_op[str(func.overloadpacket)] += 1

    def record_triton(self, fn) -> None:
        if not self.paused:
            c = self.counts[(self.phase, self.where())]
            c["triton"] += 1
            c["launch"] += 1
            self.by_op["triton:" + getattr(fn, "__name__", "?")] += 1

    # ---------------------------------------------------------------------------------- tagging autograd nodes
    def _seq_now(self) -> int:
        """The next autograd sequence number (nodes are numbered in creation order)."""
        if not self.torch.is_grad_enabled():
            return 0
        self.paused = True
        try:
            t = self.torch.ones(1, requires_grad=True)
            return t.mul(1).grad_fn._sequence_nr() + 1
        finally:
            self.paused = False

    def enter(self, name: str) -> int:
        self.stack.append(name)
        return self._seq_now()

    def leave(self, name: str, start: int, outputs) -> None:
        """Tag the autograd nodes created since `start` that lead to `outputs` with `name`, where not tagged yet
        (inner modules return first, so they keep their own tags)."""
        self.stack.pop()
        if not self.torch.is_grad_enabled():
            return
        todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
        seen = set()
        while todo:  # walk back through everything created since `start`, inner modules' nodes included
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            accumulate = not node.next_functions and "AccumulateGrad" in node.name()
            if not accumulate and node._sequence_nr() < start:
                continue
            node.metadata.setdefault("count_ops_module", name)
            todo.extend(n for n, _ in node.next_functions)

    # ------------------------------------------------------------------------------------------------- install
    def install(self):
        """Module hooks, the chunk op's wrapper and the Triton launch hook; returns a function that removes them."""
        import hybrid_attention.layers.kda as kda_layer

        starts: dict[int, list[int]] = defaultdict(list)
        hooks = []

        def pre(module, args):
            starts[id(module)].append(self.enter(self.names[module]))

        def post(module, args, out):
            self.leave(self.names[module], starts[id(module)].pop(), out)

        for module in self.names:
            hooks.append(module.register_forward_pre_hook(pre))
            hooks.append(module.register_forward_hook(post))

        real_chunk = kda_layer.chunk_kda

        def chunk(*args, **kwargs):
            name = f"{self.stack[-1]}.{CHUNK}"
            start = self.enter(name)
            out = real_chunk(*args, **kwargs)
            self.leave(name, start, out)
            return out

        kda_layer.chunk_kda = chunk
        undo_triton = _hook_triton(self)

        def remove():
            for h in hooks:
                h.remove()
            kda_layer.chunk_kda = real_chunk
            undo_triton()

        return remove


def _tensors(out):
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if hasattr(out, "__dataclass_fields__"):
        return [t for f in out.__dataclass_fields__ for t in _tensors(getattr(out, f))]
    return []


def _hook_triton(counter: OpCounter):
    """Count every Triton kernel launch (compiled or interpreted) by wrapping `run`; the ops the interpreter runs
    to move the arguments are not counted. Returns the undo."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return lambda: None
    saved = []
    for cls in (JITFunction, InterpretedFunction):
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            if not kwargs.get("warmup", False):
                counter.record_triton(getattr(self, "fn", self))
            paused, counter.paused = counter.paused, True
            try:
                return _real(self, *args, **kwargs)
            finally:
                counter.paused = paused

        cls.run = run
        saved.append((cls, real))

    def undo():
        for cls, real in saved:
            cls.run = real

    return undo


def count_step(model, ids, autocast) -> OpCounter:
    """Counts of one training step (model(ids, labels=ids).loss, then its backward), after one uncounted step."""
    import contextlib

    import torch

    amp = torch.autocast(ids.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()

    def step():
        with amp:
            loss = model(ids, labels=ids, return_logits=False).loss
        return loss

    step().backward()  # first-call work (caches, lazy inits) stays out of the count
    model.zero_grad(set_to_none=True)
    counter = OpCounter(model)
    remove = counter.install()
    try:
        with counter.mode:
            loss = step()
            counter.phase = "bwd"
            loss.backward()
    finally:
        remove()
    return counter


def count_prefill_chunk(model, prefix: int, chunk: int, packed: bool) -> OpCounter:
    """Counts of one prefill chunk of `chunk` tokens after `prefix` cached ones, as `Engine.prefill_chunk` runs it
    (no gradients, a paged cache, the engine's packed projections unless `packed` is False), after one uncounted
    run of the same shapes."""
    import torch

    from hybrid_attention.inference.paged_cache import PagedCache
    from hybrid_attention.layers.packed import PackedProjections

    device, dtype = model.embed.weight.device, model.embed.weight.dtype
    page = 64
    pages = -(-(prefix + chunk) // page)
    cache = PagedCache(
        model, num_pages=pages, page_size=page, num_slots=1, max_context=pages * page, device=device, dtype=dtype
    )
    cache.set_pages(0, range(1, pages + 1))
    projections = PackedProjections(model) if packed else None
    ids = torch.randint(0, model.config.vocab_size, (1, prefix + chunk), device=device)

    def run(start: int, end: int) -> None:
        batch = cache.batch(0, 1)
        batch.seqlens.set([start])
        model(ids[:, start:end], cache=batch, logits_to_keep=1, decode=projections)

    def fill() -> None:  # an empty slot, then the prefix
        cache.clear_slot(0)
        if prefix:
            run(0, prefix)

    counter = OpCounter(model)
    with torch.no_grad():
        fill()
        run(prefix, prefix + chunk)
        fill()
        remove = counter.install()
        try:
            with counter.mode:
                run(prefix, prefix + chunk)
        finally:
            remove()
    return counter


def _group(module: str, depth: int) -> str:
    """'layers.3.mixer.q_proj' -> 'layers.3' (depth 2) or 'layers.3.mixer' (depth 3); the chunk op's ops ->
    'layers.3.chunk_kda'; outside the layers the module's first name ('' -> 'model': the loss, the residual adds)."""
    parts = module.split(".")
    if parts[-1] == CHUNK:
        return ".".join(parts[:2] + [CHUNK])
    if parts[0] != "layers":
        return parts[0] or "model"
    return ".".join(parts[:depth])


def summarize(counter: OpCounter, layer_types) -> dict:
    """{group: {fwd_launch, bwd_launch, fwd_aten, bwd_aten}} per layer ('layers.i'), per sublayer of each layer
    ('layers.i.mixer', ...), the chunk op, the rest; per layer type the mean over its layers; totals."""
    rows: dict[str, Counter] = defaultdict(Counter)
    for (phase, module), c in counter.counts.items():
        for depth in (2, 3):
            g = _group(module, depth)
            if depth == 3 and (g == _group(module, 2)):
                continue
            for k in ("launch", "aten", "triton", "custom"):
                rows[g][f"{phase}_{k}"] += c[k]
    per_type: dict[str, Counter] = defaultdict(Counter)
    n_type = Counter(layer_types)
    for i, kind in enumerate(layer_types):
        for k, v in rows.get(f"layers.{i}", Counter()).items():
            per_type[kind][k] += v / n_type[kind]
    total, chunk = Counter(), Counter()
    for g, c in rows.items():
        if g.count(".") <= 1 or g.endswith(CHUNK):
            total.update(c)
        if g.endswith(CHUNK):
            chunk.update(c)
    return dict(rows={g: dict(c) for g, c in rows.items()}, per_type={k: dict(v) for k, v in per_type.items()},
                total=dict(total), chunk_op=dict(chunk))  # fmt: skip


def _fmt(c: dict) -> str:
    f = lambda k: f"{c.get(k, 0):,.0f}"  # noqa: E731
    launch = c.get("fwd_launch", 0) + c.get("bwd_launch", 0)
    return (f"{f('fwd_launch')} | {f('bwd_launch')} | {launch:,.0f} | {f('fwd_aten')} | {f('bwd_aten')} | "
            f"{c.get('fwd_triton', 0) + c.get('bwd_triton', 0):,.0f} | "
            f"{c.get('fwd_custom', 0) + c.get('bwd_custom', 0):,.0f}")  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3-scaled")
    p.add_argument("--residual", default="standard", help="override the preset's residual ('' keeps it)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--autocast", choices=("bf16", "none"), default="bf16")
    p.add_argument("--tiny-widths", action="store_true", help="the tiny preset's widths, the preset's layer pattern")
    kernels_help = "auto: the rule of hybrid_attention.ops.backends; triton: the CUDA path on CPU, interpreted"
    p.add_argument("--kernels", choices=("auto", "triton"), default="auto", help=kernels_help)
    p.add_argument("--top", type=int, default=25, help="list the ops launched most often")
    p.add_argument("--prefill", type=int, metavar="PREFIX", help="count one --seq-len chunk after PREFIX cached tokens")
    p.add_argument("--no-pack", action="store_true", help="--prefill without the engine's packed projections")
    args = p.parse_args(argv)
    if args.kernels == "triton" and args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

    import torch

    import hybrid_attention.ops.backends as backends
    from benchmarks.bench_common import emit_json
    from hybrid_attention.config import PRESETS, HybridConfig
    from hybrid_attention.model import HybridLM
    from hybrid_attention.ops.triton_support import triton_runs_on

    if args.kernels == "triton" and args.device == "cpu":
        # The one rule asks triton_runs_on(x, cpu_interpreter=False); here the interpreter counts as a device.
        backends.triton_runs_on = lambda x, cpu_interpreter=False: triton_runs_on(x, cpu_interpreter=True)
    overrides = {} if not args.residual else {"residual": args.residual}
    if args.tiny_widths:
        sizes = {k: v for k, v in PRESETS["tiny"].items() if k not in ("layer_types", "residual")}
        config = HybridConfig.from_preset(args.preset, **sizes, **overrides)
    else:
        config = HybridConfig.from_preset(args.preset, **overrides)
    torch.manual_seed(0)
    if args.prefill is not None:
        dtype = torch.bfloat16 if args.device != "cpu" else torch.float32  # as the server runs it
        model = HybridLM(config).to(args.device, dtype).eval()
        counter = count_prefill_chunk(model, args.prefill, args.seq_len, packed=not args.no_pack)
        what = (f"a prefill chunk of {args.seq_len} tokens after {args.prefill}, "
                f"{'unpacked' if args.no_pack else 'packed'} projections")  # fmt: skip
    else:
        model = HybridLM(config).to(args.device).train()
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), device=args.device)
        counter = count_step(model, ids, torch.bfloat16 if args.autocast == "bf16" else None)
        what = f"training step: {args.batch} x {args.seq_len}, autocast={args.autocast}"
    s = summarize(counter, config.layer_types)

    print(f"## ops per {what}: {args.preset}, residual={config.residual}, hidden {config.hidden_size}, "
          f"{args.device}, kernels={args.kernels}\n")  # fmt: skip
    head = "| {} | fwd launch | bwd launch | launch | fwd aten | bwd aten | triton | custom ops |"
    print(head.format("group") + "\n|---|---|---|---|---|---|---|---|")
    rows = s["rows"]
    key = lambda g: (g.startswith("layers."), [int(x) if x.isdigit() else x for x in g.split(".")])  # noqa: E731
    first = {f"layers.{config.layer_types.index(kind)}." for kind in set(config.layer_types)}
    for g in sorted(rows, key=key):  # sublayer rows for the first layer of each type only (all in the JSON)
        if g.count(".") < 2 or g.endswith(CHUNK) or any(g.startswith(f) for f in first):
            print(f"| {g} | {_fmt(rows[g])} |")
    print(f"| **total** | {_fmt(s['total'])} |")
    print(
        f"| total without {CHUNK} | {_fmt({k: s['total'].get(k, 0) - s['chunk_op'].get(k, 0) for k in s['total']})} |\n"
    )
    print("## per layer type (mean over its layers, without the chunk op)\n")
    print(head.format("layer") + "\n|---|---|---|---|---|---|---|---|")
    for kind, c in s["per_type"].items():
        print(f"| {kind} | {_fmt(c)} |")
    print(f"\n## the {args.top} ops launched most often (whole step)\n\n| op | count |\n|---|---|")
    for op, n in counter.by_op.most_common(args.top):
        print(f"| {op} | {n} |")
    result = dict(preset=args.preset, residual=config.residual, batch=args.batch, seq_len=args.seq_len,
                  prefill=args.prefill, packed=None if args.prefill is None else not args.no_pack,
                  device=args.device, kernels=args.kernels, autocast=args.autocast, hidden=config.hidden_size,
                  total=s["total"], chunk_op=s["chunk_op"], per_type=s["per_type"],
                  rows={g: c for g, c in rows.items() if g.count(".") < 2 or g.endswith(CHUNK)},
                  by_op=dict(counter.by_op.most_common(args.top)))  # fmt: skip
    emit_json(result, None)
    return result


if __name__ == "__main__":
    main()
