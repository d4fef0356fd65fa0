"""The memory a training step needs, from the config alone: weights, gradients, optimizer state, the bf16 weight copies
and activations autograd keeps, and the backward's working memory (docs/training.md, "How much memory a step needs").

Activations are counted per sublayer type from the tensors the current code saves for the backward, in bytes per
token under bf16 autocast; `fused` picks the kernels training runs on CUDA or their eager references.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_attention.choices import ACTIVATION_CHECKPOINTING, OPTIMIZERS
from hybrid_attention.config import HybridConfig
from hybrid_attention.model_size import ModelSize, model_size
from hybrid_attention.ops.cross_entropy import CHUNK_ELEMENTS

GIB = 2**30
CHUNK = 64  # chunk_kda's chunk length, which sizes the op's per-chunk tensors
BF16, F32, I64 = 2, 4, 8
# Muon's temporaries in the optimizer step: its stacks are built in slices of at most 64M elements (training/muon.py).
MUON_TEMPORARIES = 1 * GIB
# A card's memory as torch.cuda.get_device_properties reports it (nvidia-smi's total) for the 80 GB H100 and the H200.
CARD_MEMORY = {"h100": 81559 * 2**20, "h200": 143771 * 2**20}
CARD_NAMES = {"h100": "H100 80GB", "h200": "H200"}


def usable_bytes(total: float) -> float:
    """What a step may allocate on a card of `total` bytes: 1 GiB for the CUDA context and the kernels' workspaces,
    and 5% of the rest for the caching allocator's fragmentation."""
    return 0.95 * (total - GIB)


def kda_mixer_bytes(c: HybridConfig, fused: bool = True) -> float:
    """Bytes per token a KDA mixer keeps for its backward."""
    D, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
    HK = H * K
    conv_inputs = 3 * BF16 * HK * (1 if fused else 2)  # eager: the padded input and the output before SiLU
    low_rank = 2 * BF16 * K + F32 * H  # the decay and output-gate down projections' outputs; beta
    qkvz = 4 * BF16 * HK  # the op's inputs q, k, v (after the convs) and the per-channel gate logits
    # The op's own: Aqk, Akk and T (C per row), the chunk-start states, D, the gate's cumsum per chunk, 1/||q||, 1/||k||
    op = H * (3 * BF16 * CHUNK + BF16 * K * K / CHUNK + BF16 * K + F32 * K / CHUNK + 2 * F32)
    gated_norm = 2 * BF16 * HK if fused else 4 * F32 * HK + F32 * H  # eager: float32 copies
    return BF16 * D + conv_inputs + low_rank + qkvz + op + gated_norm + BF16 * HK  # the last: o_proj's input


def mla_mixer_bytes(c: HybridConfig) -> float:
    """Bytes per token a Gated MLA mixer keeps for its backward (the same on both paths)."""
    D, H = c.hidden_size, c.mla_num_heads
    d_c, d_s, d_v = c.mla_kv_lora_rank, c.mla_qk_shared_head_dim, c.mla_v_head_dim
    d_qk = c.mla_qk_nope_head_dim + d_s
    query = 0 if c.mla_q_lora_rank is None else 2 * BF16 * c.mla_q_lora_rank + F32  # its norm's input and output
    latent = BF16 * d_c + F32 + BF16 * (d_c + d_s)  # the latent's norm input and 1/rms, the rows [c ; k_s]
    attention = BF16 * H * (2 * d_qk + 2 * d_v) + F32 * H  # q, k, v, the output and its log-sum-exp
    gate = 2 * BF16 * H * d_v if c.mla_output_gate else 0  # sigmoid(W_g x) and the gated output, o_proj's input
    return BF16 * D + query + latent + attention + gate


def mlp_bytes(c: HybridConfig, fused: bool = True) -> float:
    """Bytes per token a SwiGLU keeps: its input and gate and up (eager: also SiLU(gate) * up)."""
    return BF16 * c.hidden_size + BF16 * c.intermediate_size * (2 if fused else 3)


def norm_bytes(c: HybridConfig) -> float:
    """Bytes per token an RMSNorm on the float32 stream keeps: its input and 1/rms."""
    return F32 * c.hidden_size + F32


def stream_bytes(c: HybridConfig) -> float:
    """Bytes per token of the residual stream: the pre-norms of every sublayer and the final norm, or the AttnRes that
    replace them (the first sublayer's plain norm, then one fused AttnRes + RMSNorm per later sublayer and at the
    end)."""
    D, S = c.hidden_size, 2 * c.num_layers  # S sublayers; S AttnRes (every sublayer but the first, and the final)
    if c.residual == "standard":
        return (S + 1) * norm_bytes(c)
    if c.residual == "attnres":
        # Per AttnRes: its normalised input, the int8 rounding residual of h, two stats, and logits over its sources
        # (2, 3, ..., S + 1 of them); the sources themselves (the embedding and S - 1 sublayer outputs, and the last).
        logits = F32 * sum(j + 1 for j in range(1, S + 1))
        return norm_bytes(c) + S * (BF16 * D + D + 2 * F32) + logits + (S + 1) * BF16 * D
    # Block AttnRes: per AttnRes the phase-1 mixture and the block's partial sum, two stats; the embedding in bf16.
    return norm_bytes(c) + S * (2 * BF16 * D + 2 * F32) + BF16 * D


def head_bytes(c: HybridConfig) -> float:
    """Bytes per token of the token ids and the LM head's loss (its bf16 input, log-sum-exp and labels)."""
    return I64 + BF16 * c.hidden_size + F32 + I64


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of one training step on one device; `peak` is what the allocator must hold at the step's worst moment."""

    parameters: int
    weights: float  # float32 parameters
    gradients: float  # float32
    optimizer: float  # AdamW's two moments; Muon's momentum for the hidden matrices
    weight_copies: float  # the bf16 copies autocast makes of the matrices, kept for the backward
    activations: float  # what autograd keeps for the backward of one micro-batch
    working: float  # the backward's transient: a sublayer's gradients (and recompute), a loss chunk
    peak: float
    per_token: dict[str, float]  # activation bytes per token by part (all layers of a type together)


def training_memory(
    config: HybridConfig,
    *,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    optimizer: str = "adamw",
    checkpointing: str = "none",
    fused: bool = True,
    size: ModelSize | None = None,
) -> TrainingMemory:
    """The memory of a step of `batch_size` x `seq_len` tokens per micro-batch, float32 parameters under bf16 autocast.

    checkpointing: which sublayers recompute their activations in the backward ("none", "mixer", "mlp", "all").
    fused: the CUDA path's fused norms, short convolutions and SwiGLU (False: their eager references, as on the CPU
    with the Triton KDA and AttnRes ops). `size`: `model_size(config)`, when the caller has it.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"training_memory: optimizer={optimizer!r}; expected one of {OPTIMIZERS}")
    if checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"training_memory: checkpointing={checkpointing!r}; expected one of {ACTIVATION_CHECKPOINTING}"
        )
    size = size or model_size(config)
    c, n, tokens = config, size.parameters, batch_size * seq_len
    counts = {t: c.layer_types.count(t) for t in size.sublayers}
    mixers = {"kda": kda_mixer_bytes(c, fused), "mla": mla_mixer_bytes(c)}
    kept_input = BF16 * c.hidden_size if fused or c.residual != "standard" else F32 * c.hidden_size
    recomputed = {"mixer": checkpointing in ("mixer", "all"), "mlp": checkpointing in ("mlp", "all")}
    per_token, copies, largest = {}, 0.0, 0.0
    for kind, count in counts.items():
        for part, full in ((f"{kind} mixer", mixers[kind]), ("mlp", mlp_bytes(c, fused))):
            sub = "mlp" if part == "mlp" else "mixer"
            params = size.sublayers[kind][sub]
            # A checkpointed sublayer keeps its input; its recompute in the backward holds its activations, their
            # gradients and its weight copies once more, for one sublayer at a time.
            kept = kept_input if recomputed[sub] else full
            per_token[part] = per_token.get(part, 0.0) + count * kept
            copies += 0 if recomputed[sub] else count * BF16 * params
            transient = 2 * full * tokens + BF16 * params if recomputed[sub] else full * tokens
            largest = max(largest, transient)
    per_token["residual stream"] = stream_bytes(c)
    per_token["head"] = head_bytes(c)
    activations = tokens * sum(per_token.values())
    loss_chunk = min(CHUNK_ELEMENTS, tokens * c.vocab_size) * (2 * F32 + BF16)  # logits, their gradient, the cast
    working = largest + loss_chunk
    weights, gradients = F32 * n, F32 * n
    matrices = sum(counts[t] * size.sublayers[t]["matrices"] for t in counts)
    optimizer_state = 2 * F32 * n if optimizer == "adamw" else F32 * matrices + 2 * F32 * (n - matrices)
    backward = activations + copies + working + (gradients if grad_accum > 1 else 0)
    step = gradients + (MUON_TEMPORARIES if optimizer == "muon" else 0)
    peak = weights + optimizer_state + max(backward, step)
    return TrainingMemory(
        parameters=n,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer_state,
        weight_copies=copies,
        activations=activations,
        working=working,
        peak=peak,
        per_token=per_token,
    )


def largest_batch(config: HybridConfig, *, seq_len: int, memory: float, **kw) -> int:
    """The most sequences of `seq_len` tokens per micro-batch whose step fits `memory` bytes (0: not even one)."""
    size = model_size(config)
    fits = lambda b: training_memory(config, batch_size=b, seq_len=seq_len, size=size, **kw).peak <= memory  # noqa: E731
    if not fits(1):
        return 0
    high = 1
    while fits(2 * high) and high < 1 << 20:
        high *= 2
    low, high = high, 2 * high  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def binary_size(n: float) -> str:
    """12345678 -> '11.8 MiB' (binary units, as the CUDA allocator counts)."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1023.95:
            return f"{n:.1f} {unit}" if unit != "bytes" else f"{n:.0f} bytes"
        n /= 1024
    return f"{n:,.1f} TiB"
