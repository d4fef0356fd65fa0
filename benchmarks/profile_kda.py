"""Where the time of our Triton KDA op goes, kernel by kernel (torch.profiler, CUDA time), on one GPU.

    python benchmarks/profile_kda.py [--shape 8,4096,16,128] [--iters 10] [--out profile_kda.json]
    python benchmarks/profile_kda.py --layer [--impls ours,fla] [--shape 8,4096,16,128]

Runs the standard configuration of bench_kda.py (bf16, gate and q/k l2norm in the kernels) for forward (inference),
and forward + backward, and prints the mean time of every kernel per call, so a regression or a slow stage shows
by name. With --layer it profiles the whole KimiDeltaAttention layer (hidden = H * D, as bench_kda.py's layer case)
instead of the op, ours and / or FLA's, so the time around the op (projections, conv, norm) shows kernel by kernel.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from bench_common import emit_json, env_info, log
from bench_kda import layer_output, make_layer, op_inputs, ours_op


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Mean CUDA time per call of every kernel `fn` launches, in ms, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():  # kernels are the events with device time of their own
        if evt.self_device_time_total > 0:
            totals[evt.key] += evt.self_device_time_total / 1000.0 / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--layer", action="store_true", help="profile the whole layer instead of the chunk op")
    p.add_argument("--impls", default="ours", help="with --layer: ours, fla or both (comma-separated)")
    args = p.parse_args(argv)
    B, T, H, D = (int(x) for x in args.shape.split(","))
    args_list = sys.argv[1:] if argv is None else argv
    result = {"env": env_info(["benchmarks/profile_kda.py", *args_list]), "shape": [B, T, H, D], "modes": {}}
    if args.layer:
        for impl in args.impls.split(","):
            result["modes"].update(profile_modes(f"{impl} layer", *layer_fns(impl, B, T, H, D), args))
    else:
        result["modes"] = profile_modes("op", *op_fns(B, T, H, D), args)
    emit_json(result, args.out)


def profile_modes(label: str, fwd, fwd_bwd, args) -> dict[str, dict[str, float]]:
    """Kernel times of the inference forward and of forward + backward, printed largest first."""
    modes = {}
    for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        times = kernel_times(fn, args.iters)
        modes[f"{label} {mode}"] = times
        log(f"\n{label} {mode} at {args.shape}: {sum(times.values()):.3f} ms of kernel time per call")
        for name, ms in times.items():
            log(f"  {ms:8.3f} ms  {name[:100]}")
    return modes


def layer_fns(impl: str, B: int, T: int, H: int, D: int):
    """(inference forward, forward + backward) of ours or FLA's layer at hidden = H * D, bf16."""
    layer = make_layer(impl, H * D, H, D)
    x = torch.randn(B, T, H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            layer_output(layer, x)

    def fwd_bwd():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer_output(layer, x).backward(dy)

    return fwd, fwd_bwd


def op_fns(B: int, T: int, H: int, D: int):
    """(inference forward, forward + backward) of our chunk op on bench_kda.py's inputs."""
    inputs = op_inputs(B, T, H, D)

    def fwd():
        with torch.no_grad():
            ours_op(*inputs)

    grads = [x.requires_grad_(True) for x in inputs]  # A_log and dt_bias too, as bench_kda.py's fwd+bwd
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        for x in grads:
            x.grad = None
        ours_op(*inputs).backward(do)

    return fwd, fwd_bwd


if __name__ == "__main__":
    main()
