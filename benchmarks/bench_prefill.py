"""Benchmark: long-prompt prefill of the k3-scaled hybrid against its all-MLA preset and transformers' Llama (SDPA) at
the same width and depth, random weights, bf16; and the MLA prefill attention alone against one causal call of torch's
SDPA (flash and cuDNN backends) on the same Q/K/V shapes.

Per prompt length (batch 1, and 32 x 32K): prefill seconds through `generate_stream` (time to the first token),
tokens/s, peak memory, and decode ms/token after the prefill (CUDA graph; median over the tokens after the capture).
Llama runs one forward with its KV cache (`logits_to_keep=1`) while it fits. Per length, one MLA layer's attention
over the whole prompt as the prefill runs it (chunks, prefix tiles, LSE merges) in effective TFLOP/s of the
decompressed form, N^2 H (d_qk + d_v) for batch 1 (docs/math.md), beside SDPA on [B, H, N, 128]; and chunk_kda over
the longest prompt in one call and in prefill chunks with the state carried. Every case runs in try/except; cases the
time budget or memory cannot hold are skipped with a note. Figures: docs/performance.md.

    python benchmarks/bench_prefill.py [--lengths 8K,32K,128K,512K,1M] [--quick] [--out r.json] [--plot p.png]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from bench_common import emit_json, env_info, log

LENGTHS = "8K,32K,128K,512K,1M"
NEW_TOKENS = 17  # the first comes from the prefill, the second's wait includes the decode graph's capture
REPEAT_UP_TO = 1 << 17  # prompts up to this length are timed on a second call (first-call plans and tuning left out)
WARM_LENGTH = 1 << 18  # one prefill this long first: it meets every attention shape a longer batch-1 prefill uses


def tokens(text: str) -> int:
    """'8K' -> 8192, '1M' -> 1048576, '300' -> 300."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def seconds(fn, device, repeat: bool) -> float:
    """Wall seconds of one call of fn (synchronised), after an untimed call when `repeat`."""
    if repeat:
        fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def build_hybrid(preset: str, device, dtype):
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM

    overrides = {"layer_types": ("mla",) * 4} if preset == "tiny-all-mla" else {}
    torch.manual_seed(0)
    config = HybridConfig.from_preset(preset.removesuffix("-all-mla") if overrides else preset, **overrides)
    model = HybridLM(config).to(device, dtype).eval()
    with torch.no_grad():  # non-trivial AttnRes mixing (the cost does not depend on it)
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0.0, 0.5)
    return model


def build_llama(config, device, dtype):
    """transformers' LlamaForCausalLM with SDPA at the hybrid's width, depth, heads, MLP and vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    head_dim = c.mla_qk_nope_head_dim + c.mla_qk_shared_head_dim
    llama = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.mla_num_heads,
        num_key_value_heads=c.mla_num_heads,
        head_dim=head_dim,
        max_position_embeddings=1 << 21,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(llama).to(device, dtype).eval()


def generate_case(model, B: int, N: int, device, repeat: bool, new_tokens: int = NEW_TOKENS) -> dict:
    """Prefill seconds (to the first token), decode ms/token and peak memory of `generate_stream`, greedy."""
    from hybrid_attention.inference.generate import generate_stream
    from hybrid_attention.inference.prefill import prefill_chunk_size

    ids = torch.randint(0, model.config.vocab_size, (B, N), device=device)
    row = dict(B=B, N=N, chunk=prefill_chunk_size(model, B))
    if repeat:
        for _ in generate_stream(model, ids, 2, temperature=0):
            pass
        free_memory(device)
    sync(device)
    stamps, start = [], time.perf_counter()
    for _ in generate_stream(model, ids, new_tokens, temperature=0):
        sync(device)
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    row.update(s=stamps[0] - start, peak_gib=peak_gib(device), repeated=repeat)
    row.update(tokens_per_s=B * N / row["s"], decode_ms=statistics.median(gaps) * 1e3 if gaps else None)
    return row


def llama_case(model, B: int, N: int, device, repeat: bool, new_tokens: int = 0) -> dict:
    """One forward that fills the KV cache and returns the last logits (what generate's prefill does). Skipped when
    its KV cache and one layer's activations (about 8 hidden and 3 MLP widths per token) would not fit."""
    c = model.config
    itemsize = next(model.parameters()).element_size()
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    need = B * N * itemsize * (kv + 8 * c.hidden_size + 3 * c.intermediate_size)
    if device.type == "cuda" and need > 0.9 * torch.cuda.mem_get_info(device)[0]:
        return dict(skipped=f"needs about {need / 2**30:.0f} GiB (KV cache and activations)")
    ids = torch.randint(0, model.config.vocab_size, (B, N), device=device)

    @torch.no_grad()
    def run():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    s = seconds(run, device, repeat)
    return dict(B=B, N=N, s=s, tokens_per_s=B * N / s, peak_gib=peak_gib(device), repeated=repeat)


def sdpa_case(B: int, H: int, N: int, d_qk: int, d_v: int, flops: float, device, dtype) -> dict:
    """One causal SDPA call on [B, H, N, d] per backend (flash, cuDNN), timed on its second call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype) for d in (d_qk, d_qk, d_v))
    row = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                s = seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, True)
            row[f"{name}_s"], row[f"{name}_tflops"] = s, flops / s / 1e12
        except Exception as exc:
            row[f"{name}_error"] = repr(exc)[:200]
    return row


@torch.no_grad()
def attention_case(config, B: int, N: int, chunk: int, device, dtype, kernels: list[str]) -> dict:
    """One MLA layer's prefill attention over N tokens in chunks (per `kernels`), and one causal SDPA call per
    backend on [B, H, N, d_qk]; effective TFLOP/s = B N^2 H (d_qk + d_v) / s."""
    from hybrid_attention.ops.mla.prefill import mla_prefill
    from hybrid_attention.ops.mla.prefix import contiguous_prefix

    H, d_c, d_v = config.mla_num_heads, config.mla_kv_lora_rank, config.mla_v_head_dim
    d_n, d_s = config.mla_qk_nope_head_dim, config.mla_qk_shared_head_dim
    d_qk = d_n + d_s
    flops = B * N * N * H * (d_qk + d_v)
    row = dict(B=B, N=N, chunk=chunk, tflop=flops / 1e12)
    row.update(sdpa_case(B, H, N, d_qk, d_v, flops, device, dtype))
    free_memory(device)
    rows = torch.randn(B, N, d_c + d_s, device=device, dtype=dtype)
    queries = torch.randn(B, N, H, d_qk, device=device, dtype=dtype)
    w_uk = (torch.randn(H, d_n, d_c, device=device) / d_c**0.5).to(dtype)
    w_uv = (torch.randn(H, d_v, d_c, device=device) / d_c**0.5).to(dtype)
    reader, scale = contiguous_prefix(rows), d_qk**-0.5
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for kernel in kernels:

        def layer(kernel=kernel):
            for a in range(0, N, chunk):
                b = min(N, a + chunk)
                q = queries[:, a:b].contiguous()  # a fresh tensor per chunk, as the layer's query projection gives
                mla_prefill(q, rows[:, a:b], w_uk, w_uv, prefix=reader, prefix_len=a, kernel=kernel, scale=scale)

        try:
            free_memory(device)
            s = seconds(layer, device, N <= REPEAT_UP_TO)
            row[f"mla_{kernel}_s"], row[f"mla_{kernel}_tflops"] = s, flops / s / 1e12
            if device.type == "cuda":  # beyond the inputs: tiles, partial outputs, merges
                row[f"mla_{kernel}_workspace_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        except Exception as exc:
            row[f"mla_{kernel}_error"] = repr(exc)[:200]
    best_sdpa = max((row.get(f"sdpa_{n}_tflops") or 0.0) for n in ("flash", "cudnn"))
    if best_sdpa and "mla_auto_tflops" in row:
        row["mla_vs_best_sdpa"] = row["mla_auto_tflops"] / best_sdpa
    return row


@torch.no_grad()
def kda_case(config, N: int, chunk: int, device, dtype) -> dict:
    """chunk_kda over N tokens at the model's KDA sizes (the layer's gate and q/k norm fused) in one call, and in
    chunks of `chunk` with the final state carried; the two final states' relative difference."""
    from hybrid_attention.layers.kda import KimiDeltaAttention
    from hybrid_attention.ops.kda import chunk_kda

    H, K = config.kda_num_heads, config.kda_head_dim
    layer = KimiDeltaAttention(config.hidden_size, H, K).to(device, dtype)
    q, k, v, z = (torch.randn(1, N, H, K, device=device, dtype=dtype) for _ in range(4))
    beta = torch.rand(1, N, H, device=device)
    gate = dict(gate="bounded", A_log=layer.A_log, dt_bias=layer.dt_bias, lower_bound=-5.0, use_qk_l2norm=True)
    h0 = torch.zeros(1, H, K, K, device=device)
    state = {}

    def run(size):
        s = h0
        for a in range(0, N, size):
            b = min(N, a + size)
            _, s = chunk_kda(
                q[:, a:b],
                k[:, a:b],
                v[:, a:b],
                z[:, a:b],
                beta[:, a:b],
                initial_state=s,
                output_final_state=True,
                **gate,
            )
        state[size] = s

    chunk_kda(q[:, :256], k[:, :256], v[:, :256], z[:, :256], beta[:, :256], initial_state=h0, **gate)  # compile
    one = seconds(lambda: run(N), device, False)
    pieces = seconds(lambda: run(chunk), device, False)
    diff = (state[N] - state[chunk]).norm() / state[N].norm()
    return dict(N=N, chunk=chunk, one_call_s=one, chunks_s=pieces, tokens_per_s=N / one, state_rel_diff=float(diff))


@torch.no_grad()
def profile_case(model, N: int, device, top: int = 15) -> dict:
    """Where one batch-1 prefill of N tokens spends GPU time (torch.profiler): kernels summed by name, the top ones
    as [name, ms, launches], and the share of the attention kernels (cuDNN, flash, ours)."""
    from hybrid_attention.inference.prefill import prefill

    ids = torch.randint(0, model.config.vocab_size, (1, N), device=device)
    cache = model.make_cache(1, N)
    activity = torch.profiler.ProfilerActivity
    activities = [activity.CUDA] if device.type == "cuda" else [activity.CPU]  # the CPU: no kernel times
    with torch.profiler.profile(activities=activities) as prof:
        prefill(model, ids, cache, progress=False)
        sync(device)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    attention = ("fmha", "flash", "cudnn", "sdpa", "attention_lse")
    att = sum(e.self_device_time_total for e in kernels if any(a in e.key.lower() for a in attention)) / 1e3
    ranked = [[e.key[:100], e.self_device_time_total / 1e3, e.count] for e in kernels[:top]]
    return dict(N=N, kernel_ms=total, attention_ms=att, top=ranked)


def plot(prefills: list[dict], path: str, device) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"no plot: matplotlib unavailable ({exc!r})"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("hybrid", "o-"), ("all-mla", "s--"), ("llama-sdpa", "^:")):
        pts = sorted((r["N"], r["s"]) for r in prefills if r["model"] == name and r["B"] == 1 and "s" in r)
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (batch 1)")
    ax.set_ylabel("prefill seconds")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    ax.set_title(f"Prefill of one prompt on {gpu}, random weights")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def print_tables(prefills, attention, kda) -> None:
    print("\nPrefill (time to the first token of generate_stream; Llama: one forward with its KV cache)")
    print(
        f"{'model':11} {'B':>3} {'tokens':>8} {'chunk':>6} {'seconds':>8} {'tokens/s':>10} {'peak GiB':>9} "
        f"{'decode ms':>9}  note"
    )
    for r in prefills:
        if "s" not in r:
            print(f"{r['model']:11} {r['B']:>3} {r['N']:>8}  {r.get('skipped') or r.get('error')}")
            continue
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        dec = f"{r['decode_ms']:.3f}" if r.get("decode_ms") is not None else "-"
        call = "second call" if r["repeated"] else "first call"
        print(
            f"{r['model']:11} {r['B']:>3} {r['N']:>8} {r.get('chunk', '-'):>6} {r['s']:>8.3f} "
            f"{r['tokens_per_s']:>10,.0f} {peak:>9} {dec:>9}  {call}"
        )
    print("\nMLA prefill attention, one layer (effective TFLOP/s of the decompressed form; SDPA: one causal call)")
    names = ("mla_auto", "mla_flash", "mla_triton", "sdpa_flash", "sdpa_cudnn")
    cols = [k for k in names if any(f"{k}_tflops" in r for r in attention)]
    print(f"{'B':>3} {'tokens':>8} {'TFLOP':>8} " + " ".join(f"{c:>11}" for c in cols) + f" {'vs best':>8}")
    for r in attention:
        cells = " ".join(f"{r[f'{c}_tflops']:>11.1f}" if f"{c}_tflops" in r else f"{'fail':>11}" for c in cols)
        ratio = f"{r['mla_vs_best_sdpa']:.2f}" if "mla_vs_best_sdpa" in r else "-"
        print(f"{r['B']:>3} {r['N']:>8} {r['tflop']:>8.1f} {cells} {ratio:>8}")
    for r in kda:
        if "one_call_s" in r:
            print(
                f"\nchunk_kda over {r['N']} tokens: one call {r['one_call_s']:.2f} s ({r['tokens_per_s']:,.0f} "
                f"tokens/s), chunks of {r['chunk']} {r['chunks_s']:.2f} s, final states differ by "
                f"{r['state_rel_diff']:.1e}"
            )


def check_thresholds(prefills, attention, kda) -> dict:
    """The benchmark's thresholds (None where a case did not run)."""
    by = {(r["model"], r["B"], r["N"]): r for r in prefills if "s" in r}
    att = {(r["B"], r["N"]): r for r in attention}
    out = {}
    for N, label, limit in ((1 << 20, "1M", 20), (1 << 19, "512K", 6), (1 << 17, "128K", 0.6)):
        r = by.get(("hybrid", 1, N))
        out[f"hybrid_{label}_s_le_{limit}"] = None if r is None else dict(s=r["s"], met=r["s"] <= limit)
    r = by.get(("hybrid", 1, 1 << 20))
    out["hybrid_1M_peak_gib_le_8"] = None if r is None else dict(gib=r["peak_gib"], met=(r["peak_gib"] or 0) <= 8)
    r = by.get(("all-mla", 1, 1 << 19))
    out["all_mla_512K_s_le_20"] = None if r is None else dict(s=r["s"], met=r["s"] <= 20)
    for N, label in ((1 << 19, "512K"), (1 << 20, "1M")):
        a = att.get((1, N), {})
        got, ratio = a.get("mla_auto_tflops"), a.get("mla_vs_best_sdpa", 0.0)
        met = None if got is None else got >= 450 and ratio >= 0.9
        out[f"mla_{label}_tflops_ge_450_and_0.9_of_best_sdpa"] = (
            None if got is None else dict(tflops=got, vs=ratio, met=met)
        )
    big = [r for r in kda if "one_call_s" in r and r["N"] >= 1 << 20]
    out["kda_1M_one_call_s_le_10"] = None if not big else dict(s=big[0]["one_call_s"], met=big[0]["one_call_s"] <= 10)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=LENGTHS, help=f"batch-1 prompt lengths (default {LENGTHS})")
    p.add_argument("--batched", default="32x32K", help="one batched case, BxN (default 32x32K; 'none' to skip)")
    p.add_argument("--quick", action="store_true", help="lengths 8K and 128K, batched 4x8K, no Llama beyond 128K")
    p.add_argument(
        "--preset", default="k3-scaled", choices=["k3-scaled", "tiny"], help="tiny: a CPU check of the script"
    )
    p.add_argument("--models", default="hybrid,all-mla,llama-sdpa", help="models to prefill (comma-separated)")
    p.add_argument(
        "--new-tokens", type=int, default=NEW_TOKENS, help=f"tokens generated after each prompt ({NEW_TOKENS})"
    )
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases predicted to end past this")
    p.add_argument("--profile", default=None, help="also profile one hybrid prefill this long (e.g. 512K)")
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument("--plot", default="benchmarks/prefill_time.png", help="PNG of prefill time against length")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64  # the CPU: a check of the script
    try:
        lengths = [tokens(x) for x in ("8K,128K" if args.quick else args.lengths).split(",")]
        batched = (
            None if args.batched == "none" else [tokens(x) for x in ("4x8K" if args.quick else args.batched).split("x")]
        )
    except ValueError:
        p.error(
            f"--lengths {args.lengths!r} --batched {args.batched!r}: expected lengths such as 8K,128K,1M and BxN "
            "such as 32x32K (or none)"
        )
    if min(lengths) < 1:
        p.error(f"--lengths {args.lengths!r}: expected positive lengths such as 8K,128K,1M")
    if batched is not None and (len(batched) != 2 or min(batched) < 1):
        p.error(f"--batched {args.batched!r}: expected BxN such as 32x32K (or none)")
    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    env = env_info(["benchmarks/bench_prefill.py", *argv])
    env["transformers"] = __import__("transformers").__version__
    models = args.models.split(",")
    result = dict(env=env, dtype=str(dtype), new_tokens=args.new_tokens, models=models)
    prefills, attention, kda, failures = [], [], [], []

    def attempt(label: str, record: dict, fn, *a, **kw) -> dict:
        try:
            return {**record, **fn(*a, **kw)}
        except torch.OutOfMemoryError:
            return dict(record, skipped="out of memory")
        except Exception as exc:
            failures.append(f"{label}: {exc!r}"[:300])
            return dict(record, error=repr(exc)[:300])
        finally:
            free_memory(device)

    from hybrid_attention.inference.prefill import prefill_chunk_size

    presets = {"hybrid": args.preset, "all-mla": f"{args.preset}-all-mla"}
    hybrid = build_hybrid(presets["hybrid"], device, dtype)
    config = hybrid.config
    warm = min(WARM_LENGTH, max(lengths))
    log(f"warm-up: hybrid prefill of {warm} tokens (kernel compilation, attention plans)")
    attempt("warm-up", {}, generate_case, hybrid, 1, warm, device, False, 2)

    def model_cases(name: str, model, run) -> None:
        last = None
        cases = [(1, N) for N in lengths] + ([tuple(batched)] if batched and name != "llama-sdpa" else [])
        for B, N in cases:
            record = dict(model=name, B=B, N=N)
            predicted = None if last is None or B != 1 else last["s"] * (N / last["N"]) ** 2
            repeat = N <= REPEAT_UP_TO or B > 1
            if predicted is not None and predicted * (2 if repeat else 1) > left():
                prefills.append(dict(record, skipped=f"predicted {predicted:.0f} s > {left():.0f} s left"))
                continue
            log(f"prefill {name} B={B} N={N} ({time.monotonic() - t0:.0f} s)")
            row = attempt(f"prefill {record}", record, run, model, B, N, device, repeat, args.new_tokens)
            prefills.append(row)
            last = row if "s" in row and B == 1 else last

    if "hybrid" in models:
        model_cases("hybrid", hybrid, generate_case)
    chunk = next((r["chunk"] for r in prefills if "chunk" in r), None) or prefill_chunk_size(hybrid, 1)
    for B, N in [(1, N) for N in lengths] + ([tuple(batched)] if batched else []):
        if left() < 30:
            attention.append(dict(B=B, N=N, skipped="time budget"))
            continue
        log(f"attention B={B} N={N} ({time.monotonic() - t0:.0f} s)")
        c = next((r["chunk"] for r in prefills if r["B"] == B and r["N"] == N and "chunk" in r), chunk)
        kernels = ["auto", "flash", "triton"] if device.type == "cuda" else ["auto"]
        args_ = (config, B, N, c, device, dtype, kernels)
        attention.append(attempt(f"attention {B}x{N}", dict(B=B, N=N), attention_case, *args_))
    kda.append(attempt(f"chunk_kda {max(lengths)}", {}, kda_case, config, max(lengths), chunk, device, dtype))
    if args.profile:
        log(f"profile: hybrid prefill of {args.profile} tokens ({time.monotonic() - t0:.0f} s)")
        result["profile"] = attempt("profile", {}, profile_case, hybrid, tokens(args.profile), device)
    del hybrid
    free_memory(device)
    if "all-mla" in models:
        model_cases("all-mla", build_hybrid(presets["all-mla"], device, dtype), generate_case)
        free_memory(device)
    if args.quick:
        lengths = [N for N in lengths if N <= REPEAT_UP_TO]
    if "llama-sdpa" in models:
        model_cases("llama-sdpa", build_llama(config, device, dtype), llama_case)

    print_tables(prefills, attention, kda)
    result.update(prefill=prefills, attention=attention, kda=kda, failures=failures)
    result["thresholds"] = check_thresholds(prefills, attention, kda)
    result["plot"] = plot(prefills, args.plot, device) if args.plot else None
    result["elapsed_s"] = time.monotonic() - t0
    if "top" in result.get("profile", {}):
        r = result["profile"]
        print(
            f"\nProfile of one hybrid prefill of {r['N']} tokens: {r['kernel_ms']:.0f} ms of kernels, attention "
            f"{r['attention_ms']:.0f} ms"
        )
        for name, ms, count in r["top"]:
            print(f"  {ms:>9.1f} ms {count:>7}  {name}")
    print("\nThresholds:", result["thresholds"])
    print(f"Failures: {len(failures)}" + "".join(f"\n  {f}" for f in failures))
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
