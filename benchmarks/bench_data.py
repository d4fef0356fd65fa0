"""The data path at scale: `tokenize` throughput, the training loader's throughput against what a training step
consumes, and the host memory of training's data path for a small and a large corpus.

The corpus is generated: documents of 20 to 400 consecutive lines of the standard library's Python sources, in JSON
lines files of 64 MB (real code, so the BPE meets real words; a fixed seed). Parts (--parts):

- tokenize: `tokenize` of a --corpus-mb corpus on --workers processes, per tokenizer (--tokenizers byte,bpe; the BPE
  has --vocab-size ids and is trained on the corpus's first 32 MB, included in the time): seconds, MB/s, MB/s per
  worker, and the CPU seconds of the processes (MB per CPU second is what a core does, on a machine shared or not).
  With --kill-after S the first run is killed after S seconds and run again to the end (the rerun keeps the finished
  shards); the time is the whole, and the CPU seconds those of the processes that ended normally.
- loader: `TrainLoader` over the tokenized corpus at --batch x --seq-len x --grad-accum tokens per step (k3-scaled's
  8 x 2048 x 2 by default), plain and with --doc-mask's document starts: tokens/s through the prefetching thread and
  computed in the caller. It is set against the tokens/s of a k3-scaled training step: measured here on CUDA (eager,
  bf16 autocast, fused AdamW, the 8 x 2048 micro-batch), or given with --step-ms.
- memory: for each size in --memory-mb, a fresh process runs what training reads from its data (open and check the
  shards, the unigram baseline, --memory-steps steps of batches, validation windows) and reports its resident memory
  (VmRSS) and peak (VmHWM) in MiB; the corpora are tokenized with the byte tokenizer (the data path does not depend on
  the tokenizer). Within 10% of each other means the data path does not grow with the corpus.

    python benchmarks/bench_data.py --parts tokenize,loader --corpus-mb 64
    python benchmarks/bench_data.py --parts tokenize --corpus-mb 2048 --tokenizers bpe --kill-after 120
    python benchmarks/bench_data.py --parts memory --memory-mb 10,2048
    python benchmarks/bench_data.py --parts loader --corpus-mb 64            # on a GPU: the step measured too

Tables on stdout, JSON as the last line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_common import checkout_env, emit_json, log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FILE_MB = 64


# ----------------------------------------------------------------------------------------------------- the corpus
def corpus(work: Path, megabytes: int, seed: int = 0) -> Path:
    """A folder of JSON lines files holding `megabytes` MB of documents (made once, then reused)."""
    folder = work / f"corpus-{megabytes}mb-seed{seed}"
    done = folder / "complete"
    if done.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    files = [p for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")) if "site-packages" not in p.parts]
    lines = []
    for path in files:
        try:
            lines.append(path.read_text(encoding="utf-8").splitlines(keepends=True))
        except (UnicodeDecodeError, OSError):
            continue
    lines = [f for f in lines if len(f) > 20]
    rng = np.random.default_rng(seed)
    target, written, part = megabytes * 1_000_000, 0, 0
    log(f"generating a {megabytes} MB corpus in {folder}")
    while written < target:
        with open(folder / f"part-{part:04d}.jsonl", "w", encoding="utf-8") as out:
            size = 0
            while size < FILE_MB * 1_000_000 and written + size < target:
                source = lines[int(rng.integers(len(lines)))]
                start = int(rng.integers(len(source)))
                text = "".join(source[start : start + int(rng.integers(20, 400))])
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                size += len(line)
        written += size
        part += 1
    done.write_text(f"{written}\n")
    return folder


def tokenized(work: Path, source: Path, tokenizer: str, vocab_size: int | None, workers: int) -> tuple[Path, float]:
    """The source tokenized into work/NAME-TOKENIZER (reused when complete); (folder, seconds it took now)."""
    from hybrid_attention.data.tokenize_corpus import Settings, tokenize

    out = work / f"{source.name}-{tokenizer}"
    start = time.perf_counter()
    tokenize(
        Settings(data=str(source), tokenizer=tokenizer, vocab_size=vocab_size),
        out,
        workers=workers,
        progress=False,
        echo=lambda *a: None,
    )
    return out, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------------- tokenize
def bench_tokenize(args, work: Path) -> list[dict]:
    source = corpus(work, args.corpus_mb)
    megabytes = sum(p.stat().st_size for p in source.glob("*.jsonl")) / 1e6
    rows = []
    for tokenizer in args.tokenizers.split(","):
        out = work / f"timed-{source.name}-{tokenizer}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        argv = [
            sys.executable,
            "-m",
            "hybrid_attention",
            "tokenize",
            "--data",
            str(source),
            "--out",
            str(out),
            "--tokenizer",
            tokenizer,
            "--workers",
            str(args.workers),
        ]
        if tokenizer == "bpe":
            argv += ["--vocab-size", str(args.vocab_size)]
        env = checkout_env()
        killed_s = None
        cpu_before = _children_cpu_s()
        start = time.perf_counter()
        if args.kill_after:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=args.kill_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed_s = time.perf_counter() - start
                log(f"{tokenizer}: killed after {killed_s:.0f} s; tokenizing again")
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        cpu_seconds = _children_cpu_s() - cpu_before
        from hybrid_attention.data.shards import read_index

        index = read_index(out)
        tokens = sum(index["splits"][s]["num_tokens"] for s in ("train", "val"))
        rows.append(
            dict(
                tokenizer=tokenizer,
                megabytes=megabytes,
                workers=args.workers,
                seconds=seconds,
                killed_after_s=killed_s,
                tokens=tokens,
                mb_per_s=megabytes / seconds,
                mb_per_s_per_worker=megabytes / seconds / args.workers,
                cpu_seconds=cpu_seconds,
                mb_per_cpu_s=megabytes / cpu_seconds,
            )
        )
        log(f"  {rows[-1]}")
    print(f"## tokenize: a {megabytes:,.0f} MB generated corpus (JSON lines), {args.workers} workers\n")
    print("| tokenizer | tokens | seconds | MB/s | MB/s per worker | CPU s | MB per CPU s | killed, then resumed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        killed = "-" if r["killed_after_s"] is None else f"after {r['killed_after_s']:.0f} s"
        print(
            f"| {r['tokenizer']} | {r['tokens']:,} | {r['seconds']:.1f} | {r['mb_per_s']:.2f} | "
            f"{r['mb_per_s_per_worker']:.2f} | {r['cpu_seconds']:.0f} | {r['mb_per_cpu_s']:.2f} | {killed} |"
        )
    print()
    return rows


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished child processes (and theirs): a machine shared with other work
    stretches the wall time, not this."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------------------------------- loader
def step_tokens_per_s(args) -> tuple[float | None, str]:
    """Tokens/s of a k3-scaled training step: --step-ms when given, else measured on CUDA, else None."""
    if args.step_ms:
        return args.batch * args.seq_len * args.grad_accum / (args.step_ms / 1e3), f"--step-ms {args.step_ms}"
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU here and no --step-ms"
    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM
    from hybrid_attention.training.step import TrainStep

    model = HybridLM(HybridConfig.from_preset("k3-scaled")).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loss = lambda ids: model(ids, labels=ids, return_logits=False).loss  # noqa: E731
    autocast = lambda: torch.autocast("cuda", torch.bfloat16)  # noqa: E731
    step = TrainStep(loss, model.parameters(), [opt], grad_accum=args.grad_accum, clip=1.0, autocast=autocast)
    ids = torch.randint(0, model.config.vocab_size, (args.grad_accum, args.batch, args.seq_len), device="cuda")
    times = []
    for i in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step.step(ids)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return ids.numel() / (ms / 1e3), f"k3-scaled eager step measured here: {ms:.1f} ms ({torch.cuda.get_device_name()})"


def bench_loader(args, work: Path) -> list[dict]:
    from hybrid_attention.data.loader import TrainLoader
    from hybrid_attention.data.training_data import open_training_data

    shards, _ = tokenized(work, corpus(work, args.corpus_mb), "byte", None, args.workers)
    data = open_training_data(str(shards))
    step_rate, step_source = step_tokens_per_s(args)
    per_step = args.batch * args.seq_len * args.grad_accum
    rows = []
    for documents in (False, True):
        kw = dict(batch_size=args.batch, seq_len=args.seq_len, grad_accum=args.grad_accum, seed=0, documents=documents)
        loader = TrainLoader(data.train, **kw)
        start = time.perf_counter()
        for step in range(1, args.loader_steps + 1):
            loader.batch(step)
        direct = per_step * args.loader_steps / (time.perf_counter() - start)
        start = time.perf_counter()
        for step in range(1, args.loader_steps + 1):
            loader.next(step)
        threaded = per_step * args.loader_steps / (time.perf_counter() - start)
        loader.close()
        rows.append(
            dict(
                documents=documents,
                tokens_per_s_thread=threaded,
                tokens_per_s_direct=direct,
                step_tokens_per_s=step_rate,
                ratio=threaded / step_rate if step_rate else None,
            )
        )
        log(f"  {rows[-1]}")
    print(
        f"## loader: {args.batch} x {args.seq_len} x {args.grad_accum} tokens per step, {args.loader_steps} steps; "
        f"step rate from {step_source}\n"
    )
    print("| document starts | tokens/s (thread) | tokens/s (caller) | a step consumes tokens/s | loader / step |")
    print("|---|---|---|---|---|")
    for r in rows:
        step = "-" if r["step_tokens_per_s"] is None else f"{r['step_tokens_per_s']:,.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.0f}x"
        print(
            f"| {'yes' if r['documents'] else 'no'} | {r['tokens_per_s_thread']:,.0f} | "
            f"{r['tokens_per_s_direct']:,.0f} | {step} | {ratio} |"
        )
    print()
    return rows


# --------------------------------------------------------------------------------------------------------- memory
def data_path_memory(shards: str, steps: int, batch: int, seq_len: int, grad_accum: int) -> dict:
    """What training reads from its data, in this process; returns VmRSS and VmHWM in MiB."""
    import torch  # a training process holds torch: part of the baseline, as in training

    from hybrid_attention.data.loader import TrainLoader, eval_starts
    from hybrid_attention.data.training_data import open_training_data
    from hybrid_attention.data.unigram import unigram_baseline

    data = open_training_data(shards)
    unigram_baseline(data.train, data.val, data.tokenizer)
    loader = TrainLoader(data.train, batch_size=batch, seq_len=seq_len, grad_accum=grad_accum, seed=0, documents=True)
    for step in range(1, steps + 1):
        batch_ids = loader.next(step).ids
        torch.as_tensor(batch_ids).sum()
    loader.close()
    for split in (data.train, data.val):
        starts = eval_starts(split.numel(), batch, seq_len, 8)
        split.windows(starts, seq_len)
    status = Path("/proc/self/status").read_text().splitlines()
    value = lambda key: int(next(line.split()[1] for line in status if line.startswith(key))) / 1024  # noqa: E731
    return {"rss_mib": value("VmRSS:"), "peak_mib": value("VmHWM:"), "train_tokens": data.train.num_tokens}


def bench_memory(args, work: Path) -> list[dict]:
    rows = []
    for megabytes in (int(m) for m in args.memory_mb.split(",")):
        shards, _ = tokenized(work, corpus(work, megabytes), "byte", None, args.workers)
        code = (
            f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.bench_data import "
            f"data_path_memory; print(json.dumps(data_path_memory({str(shards)!r}, {args.memory_steps}, "
            f"{args.batch}, {args.seq_len}, {args.grad_accum})))"
        )
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        rows.append({"corpus_mb": megabytes, **json.loads(out.stdout.strip().splitlines()[-1])})
        log(f"  {rows[-1]}")
    print(
        f"## host memory of the data path: open and check the shards, unigram baseline, {args.memory_steps} steps "
        f"of {args.batch} x {args.seq_len} x {args.grad_accum} tokens with document starts, validation windows\n"
    )
    print("| corpus | train tokens | RSS MiB | peak RSS MiB |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus_mb']:,} MB | {r['train_tokens']:,} | {r['rss_mib']:.0f} | {r['peak_mib']:.0f} |")
    if len(rows) > 1:
        spread = max(r["peak_mib"] for r in rows) / min(r["peak_mib"] for r in rows) - 1
        print(f"\nlargest peak over smallest: +{spread:.1%}")
    print()
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="tokenize,loader,memory", help="comma-separated: tokenize, loader, memory")
    p.add_argument("--work", default="/tmp/hybrid-attention-bench-data", help="generated corpora and shards (kept)")
    p.add_argument("--corpus-mb", type=int, default=64, help="corpus size of the tokenize and loader parts")
    p.add_argument("--tokenizers", default="byte,bpe", help="tokenize part: comma-separated byte, bpe")
    p.add_argument("--vocab-size", type=int, default=8192, help="the BPE's vocabulary")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenize processes (default every core)")
    p.add_argument("--kill-after", type=float, default=None, help="tokenize part: kill after S seconds, then resume")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--loader-steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=None, help="a k3-scaled step's time, instead of measuring it")
    p.add_argument("--memory-mb", default="10,2048", help="memory part: corpus sizes in MB")
    p.add_argument("--memory-steps", type=int, default=500)
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    parts = [part.strip() for part in args.parts.split(",")]
    result = {
        "command": "python " + " ".join(sys.argv if argv is None else ["benchmarks/bench_data.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    import tokenizers
    import torch

    result.update(
        torch=torch.__version__,
        tokenizers=tokenizers.__version__,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )
    if "tokenize" in parts:
        result["tokenize"] = bench_tokenize(args, work)
    if "loader" in parts:
        result["loader"] = bench_loader(args, work)
    if "memory" in parts:
        result["memory"] = bench_memory(args, work)
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
