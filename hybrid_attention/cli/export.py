"""`hybrid-attention export`: gather a torchrun run's shards into one file, or write a transformers folder."""

from __future__ import annotations

import argparse


def add_arguments(x: argparse.ArgumentParser) -> None:
    x.add_argument("--ckpt", required=True, help="run directory written by `train`")
    x.add_argument("--hf", metavar="OUT_DIR", help="new directory: transformers model + tokenizer")
    x.set_defaults(func=run)


def run(args) -> int:
    from hybrid_attention.runs import checkpoint, dist_checkpoint

    if dist_checkpoint.needs_export(args.ckpt):  # a torchrun run's DCP shards, gathered
        print(f"wrote {dist_checkpoint.export(args.ckpt)}; `generate`, `eval` and `info` read it on one device")
    elif args.hf is None:
        directory = checkpoint.latest_checkpoint(args.ckpt)
        if directory is None:
            raise checkpoint.no_checkpoint_error(args.ckpt)
        print(
            f"{directory / checkpoint.WEIGHTS} is already one file, which `generate`, `eval` and `info` read: "
            "nothing to gather (pass --hf OUT_DIR for a transformers model directory)"
        )
    if args.hf is None:
        return 0
    try:
        from hybrid_attention.hf.export import export_run
    except ImportError:
        raise ValueError("--hf needs the optional transformers package: pip install 'hybrid-attention[hf]'") from None

    out = export_run(args.ckpt, args.hf)
    print(
        f"wrote {out}; load with `import hybrid_attention.hf` and AutoModelForCausalLM.from_pretrained({str(out)!r}), "
        "or without the package with trust_remote_code=True"
    )
    return 0
