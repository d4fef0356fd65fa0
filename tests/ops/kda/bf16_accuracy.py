"""bf16 accuracy of the Triton KDA kernels on a machine without a GPU: the Triton interpreter, patched to round
float32 -> bfloat16 to nearest even as the GPU does (it truncates), against `recurrent_kda` in float64.

    python -m tests.ops.kda.bf16_accuracy [--shape B,T,H,K,V] [--gate] [--l2norm] [--seed 0]

Prints the relative L2 error of the output, the final state and every gradient. With the GPU's rounding the
interpreter's bf16 errors match those of the kernels on a GPU closely (docs/kernels.md, "Numerics"); it runs at
interpreter speed (minutes for T = 4097, K = V = 128 on two cores).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import rel_err, round_bfloat16_like_the_gpu  # noqa: E402
from tests.ops.kda.cases import make_inputs, reference_kda, run, triton_kda  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,300,2,64,64", help="B,T,H,K,V")
    p.add_argument("--gate", action="store_true", help="raw gate logits with A_log, dt_bias (fused gate)")
    p.add_argument("--l2norm", action="store_true", help="q, k normalised inside the kernels")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    inputs = make_inputs(B, T, H, K, V, gate=args.gate, l2norm=args.l2norm, dtype=torch.bfloat16, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=gen)
    dS = torch.randn(B, H, K, V, dtype=torch.float64, generator=gen)
    start = time.time()
    with pytest.MonkeyPatch.context() as patch:
        round_bfloat16_like_the_gpu(patch)
        o, S, grads = run(triton_kda, inputs, do, dS, l2norm=args.l2norm)
    took = time.time() - start
    ro, rS, rgrads = run(reference_kda, inputs, do, dS, l2norm=args.l2norm)
    errors = {"o": rel_err(o, ro), "final": rel_err(S, rS)} | {f"d{n}": rel_err(grads[n], r) for n, r in rgrads.items()}
    print(f"bf16 {args.shape} gate={args.gate} l2norm={args.l2norm} seed={args.seed} ({took:.0f} s in the interpreter)")
    for name, err in errors.items():
        print(f"  {name:<10} {err:.3e}")


if __name__ == "__main__":
    main()
