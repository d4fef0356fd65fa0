"""Benchmark: the two ceilings the other benchmarks compare against, on one CUDA GPU.

    python benchmarks/bench_ceilings.py [--out ceilings.json]

Dense bf16 matmul throughput (8192 x 8192 x 8192, `torch.matmul`) and device-to-device copy bandwidth
(`Tensor.copy_` of a 1 GiB buffer, bytes read + written), each as the median of `triton.testing.do_bench`. The
copy rate is what `COPY_CEILING_GBS` in bench_decode.py and bench_mla_decode.py stands for. Prints a table, then
one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_common import emit_json, env_info


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def matmul_median_ms(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return median_ms(lambda: torch.matmul(a, b))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument("--n", type=int, default=8192, help="matmul size n (n x n x n)")
    p.add_argument("--copy-gib", type=float, default=1.0, help="size of the copied buffer in GiB")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ceilings: needs a CUDA GPU", file=sys.stderr)
        return 1
    n = args.n
    matmul_ms = matmul_median_ms(n)
    matmul_tflops = 2 * n**3 / matmul_ms / 1e9
    numel = int(args.copy_gib * 2**30) // 2
    src = torch.empty(numel, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy_tbps = 2 * src.numel() * src.element_size() / copy_ms / 1e9

    print(f"{'ceiling':<40} {'ms':>8} {'rate':>14}")
    print(f"{f'bf16 matmul {n} x {n} x {n}':<40} {matmul_ms:>8.3f} {matmul_tflops:>9.0f} TFLOP/s")
    print(f"{f'device copy {args.copy_gib:g} GiB (read + write)':<40} {copy_ms:>8.3f} {copy_tbps:>10.2f} TB/s")
    result = dict(
        env=env_info(["benchmarks/bench_ceilings.py", *argv]),
        matmul=dict(n=n, ms=matmul_ms, tflops=matmul_tflops),
        copy=dict(bytes=src.numel() * src.element_size(), ms=copy_ms, TBps=copy_tbps),
    )
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
