#!/usr/bin/env bash
# Train k3-scaled with a byte-level BPE tokenizer on the built-in corpus (this interpreter's standard library, no
# network) on one CUDA GPU, and report tokens per second, model FLOPs utilisation,
# peak memory (torch.cuda.max_memory_allocated) and the loss curve (loss.png + log.jsonl).
#
# MFU = flops_per_token * tokens_per_s / peak, with flops_per_token = 6 * (non-embedding parameters) plus the
# sequence-mixing FLOPs (MLA causal softmax, KDA chunkwise; see hybrid_attention.metrics.flops_per_token). It is
# reported against the device's datasheet dense bf16 peak (hybrid_attention.metrics.peak_flops). tokens_per_s is
# measured after the first logged interval, which holds
# torch.compile and warm-up, and excludes evaluation and checkpoint time.
#
# Budget: about 7 minutes: BPE training and tokenisation (~1 min), then training, stopped by
# --time-limit (default 5 min, compile included) if the steps are not done by then.
#
# Usage, from anywhere (extra flags go to `hybrid-attention train` and override the ones below):
#   bash benchmarks/train_k3.sh
#   STEPS=200 COMPILE=0 bash benchmarks/train_k3.sh --optimizer muon --kda-backend fla
# Environment: STEPS (300), BATCH (4), SEQ (2048), TIME_LIMIT (minutes, 5), COMPILE (1), KDA_BACKEND (auto's
# choice on CUDA, but "triton" (else "fla") when auto would pick the memory-hungry "torch" reference), RUN_DIR
# (runs/k3-bench-DATE), RESULTS_DIR (default $OUT when set, else RUN_DIR): where config.json, log.jsonl,
# loss.png, summary.json and bench.json are copied (the weights and optimizer state stay in RUN_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=true

STEPS=${STEPS:-300}
BATCH=${BATCH:-4}  # 4 x 2048 fits on one H200 with room to spare; 16 x 2048 does not
SEQ=${SEQ:-2048}
TIME_LIMIT=${TIME_LIMIT:-5}
COMPILE=${COMPILE:-1}
RUN_DIR=${RUN_DIR:-runs/k3-bench-$(date +%Y%m%d-%H%M%S)}
RESULTS_DIR=${RESULTS_DIR:-${OUT:-$RUN_DIR}}

KDA_BACKEND=$(python - <<'EOF'
import importlib.util
import os
import sys

missing = [m for m in ("torch", "tokenizers", "safetensors", "tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"train_k3.sh: missing packages {missing}; install them with pip install -e . first")
import torch

if not torch.cuda.is_available() and os.environ.get("ALLOW_CPU") != "1":  # ALLOW_CPU=1: a smoke test of this script
    sys.exit("train_k3.sh: needs a CUDA GPU")
chosen = os.environ.get("KDA_BACKEND")
if not chosen:
    from hybrid_attention.ops.kda import resolve_backend

    chosen = resolve_backend("auto", torch.empty(1, device="cuda" if torch.cuda.is_available() else "cpu"))
    if chosen == "torch" and torch.cuda.is_available():
        # The readable chunkwise reference materialises [C, C, K] decay tensors per chunk (GBs per layer at
        # 16 x 2048 tokens): use our Triton kernels, or FLA when they are not importable.
        chosen = "triton" if importlib.util.find_spec("hybrid_attention.ops.kda.triton_chunk") else "fla"
print(chosen)
EOF
)

args=(train --preset k3-scaled --tokenizer bpe --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ"
      --device cuda --data-max-bytes 500000000 --eval-every 100 --eval-batches 4 --log-every 10
      --time-limit "$TIME_LIMIT" --kda-backend "$KDA_BACKEND" --out "$RUN_DIR")
if [ "$COMPILE" = 1 ]; then args+=(--compile); fi
args+=("$@")
echo "+ python -m hybrid_attention ${args[*]}"
start=$(date +%s)
python -m hybrid_attention "${args[@]}"
end=$(date +%s)

python - "$RUN_DIR" "$RESULTS_DIR" "$((end - start))" "python -m hybrid_attention ${args[*]}" <<'EOF'
import datetime
import importlib.metadata
import json
import shutil
import sys
from pathlib import Path

run, results, wall, command = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
summary = json.loads((run / "summary.json").read_text())
config = json.loads((run / "config.json").read_text())


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


bench = {
    "date": datetime.date.today().isoformat(),
    "gpu": summary["device"],
    "torch": summary["torch"],
    "triton": version("triton"),
    "fla-core": version("fla-core"),
    "command": command,
    "wall_s_total": wall,
    "steps_done": summary["step"],
    "steps": summary["steps"],
    "batch_tokens": config["train"]["batch_size"] * config["train"]["seq_len"] * config["train"]["grad_accum"],
    "kda_backend": config["model"]["kda_backend"],
    "vocab_size": config["model"]["vocab_size"],
    **{k: summary[k] for k in ("parameters", "tokens_per_s", "flops_per_token", "mfu",
                               "peak_memory_bytes", "train_loss", "val_loss", "val_bpb",
                               "unigram_loss", "unigram_bpb")},
}
rows = [
    ("GPU", bench["gpu"]),
    ("torch / triton / fla-core", f"{bench['torch']} / {bench['triton']} / {bench['fla-core']}"),
    ("parameters", f"{bench['parameters']:,}"),
    ("steps done", f"{bench['steps_done']} of {bench['steps']} ({bench['batch_tokens']:,} tokens per step)"),
    ("tokens/s (steady state)", f"{bench['tokens_per_s']:,.0f}"),
    ("FLOPs per token", f"{bench['flops_per_token']:.4g}"),
    ("MFU (datasheet bf16 peak)", "unknown" if bench["mfu"] is None else f"{bench['mfu']:.1%}"),
    ("peak memory", f"{(bench['peak_memory_bytes'] or 0) / 2**30:.2f} GiB"),
    ("final train / val loss", f"{bench['train_loss']:.4f} / {bench['val_loss']:.4f} nats per token"),
    ("val bits per byte", f"{bench['val_bpb']:.4f} (unigram {bench['unigram_bpb']:.4f})"),
    ("wall time, all included", f"{wall} s"),
]
width = max(len(k) for k, _ in rows)
for key, value in rows:
    print(f"{key:<{width}}  {value}")
(run / "bench.json").write_text(json.dumps(bench, indent=2) + "\n")
results.mkdir(parents=True, exist_ok=True)
if results.resolve() != run.resolve():
    for name in ("config.json", "log.jsonl", "loss.png", "summary.json", "bench.json"):
        shutil.copy(run / name, results / name)
print(f"files: {results}/{{config.json,log.jsonl,loss.png,summary.json,bench.json}}")
print(json.dumps(bench))
EOF
