"""Registers, spills and shared memory of the Triton KDA and AttnRes kernels for an sm_90 GPU, on a machine without one.

    python tools/kernel_stats.py [--shape B,T,H,K,V] [--dtype bf16] [--no-gate | --softplus] [--no-l2norm]
        [--forward-only] [--sass]
    python tools/kernel_stats.py --attnres D [--dtype bf16] [--sass]

The second form compiles the Attention Residuals training kernels (Full: forward, backward, residual-stream
backward; Block: both phases, forward and backward) at width D instead.

Runs the forward and backward host functions on CPU tensors with a stand-in Triton driver whose launches only
compile (nothing executes, outputs are garbage), then reads the resource use (cuobjdump) of every compiled kernel.
Spilled registers in these kernels cost far more than any tuning gains, so this is the first check after a
kernel change; it needs the `triton` package (its bundled ptxas and cuobjdump) but no CUDA. Every kernel compiles
its first config only (`first_configs_only`). --sass adds each kernel's static SASS instruction count
and its most frequent opcodes: the prep kernel is bound by the instructions it issues at low occupancy
(docs/kernels.md), so a change that removes instructions without adding registers is the one to time. It also
counts the global loads and stores by width (LDG.E.128 against LDG.E.U16 ...), which shows rows read one element
at a time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

# Before triton is imported: with TRITON_INTERPRET=1 exported (as for the CPU tests) it would load as the
# interpreter, and dropping the variable later breaks its imports.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

ARCH = 90
COMPILED: list[tuple[str, dict, object]] = []


class CompileOnlyDriver:
    """The part of a Triton driver that JITFunction.run touches before a launch, pointing at sm_90."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):  # the autotuner "times" each config: compile it once, report a dummy time
        def bench(call, quantiles=None, **kwargs):
            call()
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench


def _compile_only_run(self, *args, grid, warmup, **kwargs):
    kernel = _original_run(self, *args, grid=grid, warmup=True, **kwargs)
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    consts = {k: v for k, v in kwargs.items() if k.isupper() and not isinstance(v, torch.Tensor)}
    COMPILED.append((self.__name__, {**opts, **consts}, kernel))
    return kernel


_original_run = JITFunction.run


def cuobjdump(cubin: bytes, flag: str) -> str:
    """The text `cuobjdump <flag>` prints for a compiled kernel (Triton's bundled cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> str:
    """REG / STACK / LOCAL of a compiled kernel from cuobjdump. Spills show as STACK > 0 at the register cap (255):
    ptxas puts spilled registers in the stack frame; LOCAL counts other local arrays."""
    text = cuobjdump(cubin, "--dump-resource-usage")
    field = lambda name: (re.search(rf"\b{name}:(\d+)", text) or [None, "?"])[1]
    return f"regs {field('REG'):>4}  stack {field('STACK'):>6} B  local {field('LOCAL'):>6} B"


def count_opcodes(sass: str) -> collections.Counter:
    """Opcodes (without modifiers) of the instructions in cuobjdump --dump-sass text; a predicate (@P0) is skipped."""
    ops = collections.Counter()
    for line in sass.splitlines():  # "        /*0a30*/   @!P0 FADD.FTZ R3, R2, R1 ;  /* 0x... */"
        if not line.strip().startswith("/*") or ";" not in line:
            continue
        words = line.split("*/", 1)[1].split()
        if words:
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            ops[op.split(".")[0]] += 1
    return ops


def global_accesses(sass: str) -> collections.Counter:
    """Global loads and stores (LDG, STG) of cuobjdump --dump-sass text by their full opcode, whose suffix gives the
    width: LDG.E.U16 is one 2-byte element per instruction, LDG.E.128 a 16-byte vector. Many narrow ones on a tile's
    rows mean the compiler could not prove the rows aligned (a pointer loaded from memory carries no alignment)."""
    return collections.Counter(re.findall(r"\b((?:LDG|STG)(?:\.[A-Z0-9_]+)*)(?![A-Z0-9_])", sass))


def sass_summary(cubin: bytes, top: int = 8) -> str:
    """Static instruction count of a compiled kernel, its `top` most frequent opcodes and its global loads and
    stores by width (cuobjdump --dump-sass)."""
    sass = cuobjdump(cubin, "--dump-sass")
    ops = count_opcodes(sass)
    common = " ".join(f"{op} {n}" for op, n in ops.most_common(top))
    memory = " ".join(f"{op} {n}" for op, n in sorted(global_accesses(sass).items()))
    return f"    {sum(ops.values())} SASS instructions: {common}\n    global loads and stores: {memory}"


def compile_kda(args, dtype) -> str:
    """Runs the KDA forward (and backward) host functions; -> the heading line of the report."""
    from hybrid_attention.ops.kda.chunk_bwd import kda_bwd
    from hybrid_attention.ops.kda.chunk_fwd import kda_fwd
    from hybrid_attention.ops.kda.gate import FORM_CODES

    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    gate, l2 = not args.no_gate, not args.no_l2norm
    q, k, g = (torch.randn(B, T, H, K, dtype=dtype) for _ in range(3))
    v = torch.randn(B, T, H, V, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype)
    a_log, dt_bias = torch.zeros(H), torch.zeros(H, K)
    form = None if not gate else "softplus" if args.softplus else "bounded"
    lower_bound = 0.0 if form == "softplus" else -5.0  # the host's values: the softplus gate ignores it
    common = dict(scale=K**-0.5, lower_bound=lower_bound, gate=FORM_CODES[form], l2norm=l2)
    o, ht, saved = kda_fwd(q, k, v, g, beta, a_log, dt_bias, None, None, final=True, save=True, **common)
    if not args.forward_only:
        kda_bwd(torch.randn_like(o), None, q, k, v, g, beta, a_log, dt_bias, False, None, saved, **common)
    return f"sm_{ARCH}, triton {triton.__version__}, shape {args.shape}, {args.dtype}, gate={form}, l2norm={l2}"


def compile_attnres(D: int, dtype) -> str:
    """Runs the host functions of the AttnRes training kernels at width D; -> the heading line of the report."""
    from hybrid_attention.ops.attnres import (
        triton_block_merge,
        triton_block_partial,
        triton_mix_norm,
        triton_stream_bwd,
    )

    M, S, K, Q = 8, 3, 4, 4
    cdt = torch.float32  # the parameters' and statistics' dtype under every source dtype
    src = [torch.randn(M, D, dtype=dtype) for _ in range(S)]
    w = lambda *shape: torch.randn(*shape, dtype=cdt)  # noqa: E731
    x, h, h_res, stats, logits = triton_mix_norm.full_fwd(
        src, w(D), w(D), w(D), 1e-6, 1e-6, save_h=True, save_logits=True
    )
    triton_mix_norm.full_bwd(x, src, w(D), w(D), w(D), stats, 1e-6)
    rows = torch.zeros(K, 2 + S + K - 1, M, dtype=cdt)
    splits, programs = triton_stream_bwd.param_table_rows(M, x.device)
    k_split = K - 1  # step 1 below writes its row of the early dh table and reads both tables
    tables = (torch.zeros(k_split, M, D, dtype=dtype), torch.zeros(K - k_split, M, D, dtype=dtype), rows)
    tables += (torch.zeros(1 + splits + programs, K, D, dtype=cdt),)
    saved = (h, h_res, stats, logits)
    triton_stream_bwd.stream_bwd_(x, *saved, w(K, D), w(K, D), w(D), src[-1:], *tables, 1, 1e-6)
    triton_stream_bwd.stream_bwd_(x, *saved, w(K, D), w(K, D), w(D), src[-2:], *tables, 1, 1e-6)  # a table
    out, lse = triton_block_partial.partial_fwd(src, w(Q, D), w(Q, D), 1e-6)
    triton_block_partial.partial_bwd(out, lse, src, w(Q, D), w(Q, D), lse, 1e-6)  # out: Q tensors, read as gradients
    many = src * 3  # past one tile of blocks: the row-at-a-time phase-1 backward
    triton_block_partial.partial_bwd(out, lse, many, w(Q, D), w(Q, D), lse, 1e-6)
    xm, rho = triton_block_merge.merge_norm_fwd(out[0], lse[0], src[0], w(D), w(D), w(D), 1e-6, 1e-6, dtype)
    triton_block_merge.merge_norm_bwd(xm, out[0], lse[0], src[0], w(D), w(D), w(D), rho, 1e-6)
    return f"sm_{ARCH}, triton {triton.__version__}, AttnRes training kernels, D {D}, {dtype}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,256,2,128,128", help="B,T,H,K,V (the kernels do not depend on B, T, H)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    gate_form = ap.add_mutually_exclusive_group()
    gate_form.add_argument("--no-gate", action="store_true", help="g precomputed, no gate in the kernels")
    gate_form.add_argument("--softplus", action="store_true", help="the fused gate without a lower bound (softplus)")
    ap.add_argument("--no-l2norm", action="store_true")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--sass", action="store_true", help="also the static SASS instruction count per kernel")
    ap.add_argument("--attnres", type=int, metavar="D", help="the AttnRes training kernels at width D instead")
    args = ap.parse_args()
    from hybrid_attention.ops.attnres.rows import MAX_ROW

    if args.attnres is not None:
        if not 0 < args.attnres <= MAX_ROW:
            ap.error(
                f"--attnres: expected a width D in 1 .. {MAX_ROW} (the kernels hold whole rows), got {args.attnres}"
            )
        kda_only = {
            "--shape": args.shape != ap.get_default("shape"),
            "--no-gate": args.no_gate,
            "--softplus": args.softplus,
            "--no-l2norm": args.no_l2norm,
            "--forward-only": args.forward_only,
        }
        if any(kda_only.values()):
            ap.error(f"--attnres takes --dtype and --sass only, got {', '.join(k for k, v in kda_only.items() if v)}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    driver.set_active(CompileOnlyDriver())
    JITFunction.run = _compile_only_run
    from hybrid_attention.ops.triton_cache import first_configs_only

    with first_configs_only():
        print(compile_attnres(args.attnres, dtype) if args.attnres is not None else compile_kda(args, dtype))
    seen = set()
    for name, consts, kernel in COMPILED:
        key = (name, tuple(sorted(consts.items())))
        if key in seen:  # the autotuner's dummy "timing" call and the real call compile the same kernel
            continue
        seen.add(key)
        shared = kernel.metadata.shared
        usage = resource_usage(kernel.asm["cubin"])
        show = {k: v for k, v in consts.items() if k in ("BV", "BK", "num_warps", "num_stages")}
        print(f"{name:<24} {usage}  smem {shared:>6} B  {show}")
        if args.sass:
            print(sass_summary(kernel.asm["cubin"]))


if __name__ == "__main__":
    main()
