"""The settings of a training run (`TrainConfig`): their defaults per preset, the flags that may change on a resume,
and the checks that turn a bad flag or a damaged config.json into an error naming the setting."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields

from hybrid_attention.checks import is_int
from hybrid_attention.choices import (
    ACTIVATION_CHECKPOINTING,
    ATTNRES_BACKENDS,
    DEVICES,
    DTYPES,
    FP8_RECIPES,
    KDA_BACKENDS,
    OPTIMIZERS,
    REPORTERS,
    TOKENIZERS,
)
from hybrid_attention.runs import run_config

# Defaults that depend on the model size: the tiny preset must finish on a 2-core CPU in about 3 minutes; the larger
# ones read the environment's Python sources (hundreds of MB, no repeats within a run) and keep 16 x 2048 tokens per
# step as two micro-batches of 8, which leaves headroom on an 80 GB card. eval_every None: a tenth of the run; tiny
# evaluates 4 batches of each split, which keeps its eleven validations cheap on a CPU.
_TINY = dict(
    steps=250,
    batch_size=8,
    seq_len=128,
    grad_accum=1,
    lr=3e-3,
    warmup=25,
    eval_every=None,
    eval_batches=4,
    log_every=10,
)
_SCALED = dict(
    steps=300,
    batch_size=8,
    seq_len=2048,
    grad_accum=2,
    lr=1e-3,
    warmup=50,
    eval_every=None,
    eval_batches=8,
    log_every=10,
    data="python-env",
)
# k3-3b keeps the 16 x 2048 tokens per step as four micro-batches of 4 with the mixers recomputed, which fits an 80 GB
# card with AdamW (`hybrid-attention info --preset k3-3b --card h100` gives the estimate).
_PRESET_DEFAULTS = {"k3-3b": dict(_SCALED, batch_size=4, grad_accum=4, activation_checkpointing="mixer")}


@dataclass
class TrainConfig:
    """Every setting of a training run. Fields in RUN_ONLY may change on --resume; the others are the run's own."""

    preset: str = "tiny"
    steps: int = _TINY["steps"]
    batch_size: int = _TINY["batch_size"]
    seq_len: int = _TINY["seq_len"]
    grad_accum: int = 1
    lr: float = _TINY["lr"]
    min_lr_ratio: float = 0.1
    warmup: int = _TINY["warmup"]
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    clip: float = 1.0
    data: str | None = None
    data_max_bytes: int | None = None
    tokenizer: str | None = None  # None: byte, or the one a folder of shards was tokenized with
    vocab_size: int | None = None
    doc_mask: bool = False  # every document its own sequence (packed, `cu_seqlens`): docs/training.md
    seed: int = 0
    out: str = "runs/tiny"
    eval_every: int | None = _TINY["eval_every"]  # None: a tenth of the run (run_report.validation_interval)
    eval_batches: int = _TINY["eval_batches"]
    log_every: int = _TINY["log_every"]
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    cuda_graph: bool = False  # replay the whole step from a CUDA graph (train_step.py): CUDA, one process
    kda_backend: str | None = None  # None: "auto"; how the run executes, not part of the model
    attnres_backend: str | None = None  # None: "auto"
    extended_at: tuple[int, ...] = ()  # the --steps at which --extend-steps added more: each starts a schedule tail
    stop_after: int | None = None
    time_limit: float | None = None  # minutes
    report_to: tuple[str, ...] = ()  # where the curves go besides log.jsonl: "tensorboard", "wandb"
    # Which sublayers recompute their activations in the backward: "none", "mixer", "mlp" or "all" (runs saved before
    # the choice stored True for "all" and False for "none").
    activation_checkpointing: str | bool = "none"
    fp8: str | None = None  # torchao float8 training of the large projections: "tensorwise" or "rowwise" scaling
    # Under torchrun (distributed.py): FSDP2 memory options and the process-group timeout.
    fsdp_reshard_after_forward: bool = False
    dist_timeout: float = 600.0  # seconds

    @classmethod
    def create(cls, saved: dict | None = None, *, extend_steps: int | None = None, **given) -> TrainConfig:
        """Settings from preset defaults, then the run's saved settings (on resume), then the flags `given`.

        On resume a given flag that changes a setting outside RUN_ONLY raises ValueError, and `extend_steps` adds
        steps after the run's last one (`extended`). The saved settings (read from config.json) and the given ones
        are type-checked like command-line input.
        """
        given = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in given.items() if v is not None}
        given = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}  # as JSON holds them
        run_config.check_fields(given, cls, "TrainConfig")
        if saved is not None:
            run_config.check_fields(
                saved, cls, f"{given.get('out', saved.get('out'))}/config.json train section", required=SAVED_REQUIRED
            )
            changed = [
                f"--{k.replace('_', '-')} {given[k]} (the run has {_stored(k, saved.get(k))})"
                for k in sorted(given)
                if k not in RUN_ONLY and given[k] != saved.get(k)
            ]
            if changed:
                free = ", ".join(f"--{k.replace('_', '-')}" for k in sorted(RUN_ONLY - {"out"}))
                more = "; --extend-steps N trains it N steps further" if "steps" in given else ""
                raise ValueError(
                    f"a resumed run keeps its settings, but {'; '.join(changed)}; only {free} may change{more}"
                )
            once = {"stop_after", "time_limit"}  # they describe one invocation, not the run
            values = {k: v for k, v in saved.items() if k in {f.name for f in fields(cls)} and k not in once}
            config = cls(**{**values, **given})
            return (config.extended(extend_steps) if extend_steps is not None else config).validate()
        if extend_steps is not None:
            raise ValueError("--extend-steps trains a run further: pass --resume (and its --out) with it")
        preset = given.get("preset", "tiny")
        defaults = _TINY if preset == "tiny" else _PRESET_DEFAULTS.get(preset, _SCALED)
        merged = {"out": f"runs/{preset}", **defaults, **given}
        if "warmup" not in given:  # short runs (tests, smoke checks) warm up for at most a fifth of their steps
            merged["warmup"] = min(defaults["warmup"], merged["steps"] // 5)
        return cls(**merged).validate()

    def extended(self, more_steps: int) -> TrainConfig:
        """The run with `more_steps` more steps after its last one, the learning rate on a new schedule tail from
        there (`optim.lr_factor`)."""
        if not is_int(more_steps) or more_steps < 1:
            raise ValueError(f"--extend-steps must be a positive integer, got {more_steps!r}")
        extended_at = (*tuple(self.extended_at), self.steps)
        return dataclasses.replace(self, steps=self.steps + more_steps, extended_at=extended_at)

    def validate(self) -> TrainConfig:
        if not self.out.strip():
            raise ValueError("--out must name a run directory, got an empty string")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches", "log_every"):
            value = getattr(self, name)
            if name == "eval_every" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2 (one prediction per window), got {self.seq_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"--warmup must be between 0 and --steps ({self.steps}), got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.weight_decay >= 0 or not self.clip >= 0:
            raise ValueError(f"--weight-decay and --clip must be >= 0, got {self.weight_decay} and {self.clip}")
        checks = (("optimizer", OPTIMIZERS), ("tokenizer", (None, *TOKENIZERS)), ("device", DEVICES), ("dtype", DTYPES))
        checks += (("kda_backend", (None, *KDA_BACKENDS)), ("attnres_backend", (None, *ATTNRES_BACKENDS)))
        for name, choices in checks:
            if getattr(self, name) not in choices:
                allowed = ", ".join(c for c in choices if c is not None)
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.tokenizer != "bpe" and self.vocab_size not in (None, 256):
            raise ValueError(f"--vocab-size {self.vocab_size} needs --tokenizer bpe (the byte tokenizer has 256)")
        if self.vocab_size is not None and self.vocab_size > MAX_VOCAB:
            raise ValueError(f"--vocab-size must be at most {MAX_VOCAB:,}, got {self.vocab_size:,}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be between 0 and 2**63 - 1, got {self.seed}")
        if self.data_max_bytes is not None and self.data_max_bytes < 1:
            raise ValueError(f"--data-max-bytes must be a positive number of bytes, got {self.data_max_bytes}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"--time-limit must be a positive number of minutes, got {self.time_limit}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be a positive number of seconds, got {self.dist_timeout}")
        if self.doc_mask and self.cuda_graph:
            raise ValueError(
                "--doc-mask runs eagerly: the documents of a batch change its shapes; leave out --cuda-graph"
            )
        checkpointing = self.activation_checkpointing
        if isinstance(checkpointing, bool):
            self.activation_checkpointing = "all" if checkpointing else "none"
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            allowed = ", ".join(ACTIVATION_CHECKPOINTING)
            raise ValueError(f"--activation-checkpointing must be one of {allowed}, got {checkpointing!r}")
        if self.fp8 not in (None, *FP8_RECIPES):
            raise ValueError(f"--fp8 must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")
        self.report_to = tuple(self.report_to)
        unknown = [r for r in self.report_to if r not in REPORTERS]
        if unknown:
            raise ValueError(f"--report-to must be among {', '.join(REPORTERS)}, got {', '.join(map(str, unknown))}")
        self.extended_at = tuple(self.extended_at)  # a JSON list in config.json
        bounds = (*self.extended_at, self.steps)
        if not all(is_int(a) and 1 <= a < b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(
                f"extended_at must be increasing steps below --steps ({self.steps}), got {self.extended_at}"
            )
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after must be between 1 and --steps ({self.steps}), got {self.stop_after}")
        return self


def _stored(name: str, value) -> str:
    """A saved setting as a message shows it: None, which config.json stores for a default, by what it stands for."""
    if value is not None:
        return str(value)
    return {"data": "builtin, the default"}.get(name, "the default")


# where and how the run executes
_WHERE = {"out", "device", "dtype", "compile", "cuda_graph", "kda_backend", "attnres_backend"}
_WHERE |= {"activation_checkpointing", "fp8"}  # how it computes: the model and its results are the same run's
_WHERE |= {"fsdp_reshard_after_forward", "dist_timeout"}  # and over how many processes
_WHEN = {"stop_after", "time_limit", "log_every", "eval_every", "eval_batches", "report_to"}  # when and where it logs
RUN_ONLY = _WHERE | _WHEN  # the settings that may change on --resume
# Settings every run has stored since the format began (a config.json without one is damaged, not old).
SAVED_REQUIRED = (
    "preset",
    "steps",
    "batch_size",
    "seq_len",
    "grad_accum",
    "lr",
    "min_lr_ratio",
    "warmup",
    "optimizer",
    "weight_decay",
    "clip",
    "data",
    "data_max_bytes",
    "tokenizer",
    "vocab_size",
    "seed",
)
MAX_VOCAB = 1 << 20  # ample for BPE; a huge request (1e9) makes the tokenizers trainer abort the process
