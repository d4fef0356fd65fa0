"""`hybrid-attention serve`: an OpenAI-compatible completions server over the continuous-batching engine."""

from __future__ import annotations

import argparse
import sys

from hybrid_attention.arg_types import non_negative_float, non_negative_int, number, positive_int
from hybrid_attention.choices import DEVICES, DTYPES
from hybrid_attention.cli.common import add_backend_flags, backends, device_and_dtype
from hybrid_attention.config import PRESETS  # torch-free: --help and bad flags answer before torch loads


def add_arguments(v: argparse.ArgumentParser) -> None:
    source = v.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="run directory written by `train`, or a folder written by `export --hf`")
    source.add_argument(
        "--preset",
        choices=PRESETS,
        help="random weights of a preset with the byte vocabulary, to measure the server (its text is noise)",
    )
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=number(int, 0, high=65535), default=8000, help="default 8000; 0: any free port")
    v.add_argument("--device", choices=DEVICES, default="auto")
    v.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on CUDA")
    v.add_argument("--model-name", help="the model id clients send (default: the run directory's name)")
    v.add_argument("--max-running", type=positive_int, default=64, help="sequences decoding at once (default 64)")
    v.add_argument(
        "--max-context",
        type=positive_int,
        default=8192,
        help="prompt + completion tokens of one request (default 8192)",
    )
    v.add_argument(
        "--max-queue", type=non_negative_int, default=256, help="requests waiting for cache; more get 429 (default 256)"
    )
    v.add_argument(
        "--max-batched-tokens",
        type=positive_int,
        help="prompt tokens per engine iteration while sequences decode (default 8192 on a GPU, 2048 on a CPU)",
    )
    v.add_argument("--max-prefilling", type=positive_int, default=4, help="prompts in prefill at once (default 4)")
    v.add_argument(
        "--max-prefill-chunk",
        type=positive_int,
        help="prompt tokens per iteration while nothing decodes (default: from the free memory on CUDA, 1024 on a CPU)",
    )
    v.add_argument("--page-size", type=positive_int, default=64, help="tokens per latent cache page (default 64)")
    v.add_argument(
        "--cache-memory-fraction",
        type=number(float, 0.0, inclusive=False, high=1.0),
        default=0.9,
        help="CUDA: share of the GPU's memory the server fills, weights included (default 0.9)",
    )
    v.add_argument(
        "--num-pages",
        type=positive_int,
        help="latent cache pages (default: from the memory fraction "
        "on CUDA, enough for --max-running full contexts on the CPU)",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM (default 30)",
    )
    v.add_argument(
        "--stream-interval",
        type=non_negative_float,
        default=0.0,
        help="least seconds between two chunks of a stream (default 0: send tokens as they come)",
    )
    v.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (slower; for debugging)")
    add_backend_flags(v)
    v.set_defaults(func=run)


def run(args) -> int:
    try:
        from hybrid_attention.inference.server import run_server
    except ImportError as e:
        raise ValueError(
            f"serve needs FastAPI, uvicorn and prometheus_client ({e.name} is missing): "
            "pip install 'hybrid-attention[serve]'"
        ) from None
    from hybrid_attention.inference.engine import Engine
    from hybrid_attention.inference.engine_config import EngineConfig
    from hybrid_attention.inference.model_source import load_for_serving
    from hybrid_attention.ops.warm_start import warm_start

    config = EngineConfig(
        max_running=args.max_running,
        max_context=args.max_context,
        max_queue=args.max_queue,
        max_batched_tokens=args.max_batched_tokens,
        max_prefilling=args.max_prefilling,
        max_prefill_chunk=args.max_prefill_chunk,
        page_size=args.page_size,
        num_pages=args.num_pages,
        cache_memory_fraction=args.cache_memory_fraction,
        cuda_graphs=False if args.no_cuda_graphs else None,
    )
    device, dtype = device_and_dtype(args)
    warm_start(device, dtype=dtype)
    model, tokenizer, name = load_for_serving(
        ckpt=args.ckpt, preset=args.preset, device=device, dtype=dtype, **backends(args)
    )
    engine = Engine(model, tokenizer, config)
    engine.warm_up()
    name = args.model_name or name
    cache_gib = engine.cache.nbytes() / 2**30

    def ready(host: str, port: int) -> None:
        print(
            f"hybrid-attention serve: ready at http://{host}:{port}/v1, model {name!r} on {device} "
            f"({str(dtype).replace('torch.', '')}): {engine.num_pages} cache pages of {config.page_size} tokens "
            f"({cache_gib:.2f} GiB with the state slots), up to {config.max_running} running sequences of "
            f"{config.max_context} tokens",
            file=sys.stderr,
            flush=True,
        )

    run_server(
        engine,
        host=args.host,
        port=args.port,
        model_name=name,
        shutdown_timeout=args.shutdown_timeout,
        on_ready=ready,
        stream_interval=args.stream_interval,
    )
    return 0
