"""Training on many processes: torchrun's environment, the process group, FSDP2 sharding and the batch split
(docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 600.0
FP32_PARAMS = ("A_log", "dt_bias")  # kept in float32 whatever the parameter dtype: exp() / softplus() of them
_ERROR_KEY = "hybrid_attention/error/"


def launched() -> bool:
    """Whether this process was started by torchrun (or anything else that sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class Parallel:
    """Where this process sits among the ranks, and the few collectives the training loop needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device | None = None
    mesh: object | None = None  # DeviceMesh; None in a single process

    @classmethod
    def single(cls, device: torch.device | None = None) -> Parallel:
        return cls(device=device)

    @classmethod
    def from_env(cls, device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> Parallel:
        """Join the process group described by torchrun's variables. NCCL on CUDA (one GPU per local rank),
        gloo on CPU. ValueError when a variable is missing or the device does not exist."""
        missing = [name for name in ENV_VARS if name not in os.environ]
        if missing:
            raise ValueError(
                f"distributed training needs {', '.join(missing)} in the environment (start it with torchrun)"
            )
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if local >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK {local} has no GPU: this machine has {torch.cuda.device_count()}; start at most that "
                    "many processes per node (--nproc_per_node)"
                )
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kw)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world,))
        if rank != 0:  # rank 0 alone reports; errors still reach stderr on every rank
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
        return cls(rank=rank, world_size=world, local_rank=local, device=dev, mesh=mesh)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, draws the progress bar, plots and writes the run's plain files."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch [B, ...] -> [B / world_size, ...] (a tensor or a list)."""
        if self.world_size == 1:
            return batch
        b = batch.shape[0] // self.world_size
        return batch[self.rank * b : (self.rank + 1) * b]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over ranks (every rank gets it)."""
        if self.world_size == 1:
            return value
        value = value.detach().clone().float()
        dist.all_reduce(value)
        return value / self.world_size

    def maxima(self, *values: float) -> tuple[float, ...]:
        """The maximum of each value over ranks, on every rank: for decisions all ranks must take together (a flag
        True anywhere is True everywhere). One small all-reduce and a host sync per call."""
        if self.world_size == 1:
            return values
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(t.tolist())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def check_same(self, what: str, value: str) -> None:
        """ValueError naming the ranks that disagree when `value` (a short string, e.g. a hash) differs."""
        if self.world_size == 1:
            return
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        if len(set(values)) > 1:
            ranks = [r for r, v in enumerate(values) if v != values[0]]
            raise ValueError(
                f"ranks {ranks} built a different {what} from rank 0; every rank must read the same inputs"
            )

    def close(self) -> None:
        if self.sharded and dist.is_initialized():
            dist.destroy_process_group()

    # ----------------------------------------------------------------------------------------- failure handling
    def run(self, fn: Callable[[], object]) -> object:
        """`fn()`, turning an error on any rank into the same one-line ValueError on every rank.

        A rank that fails records its message in the rendezvous store and leaves; the others fail in their next
        collective (the peer is gone, or the process-group timeout passes), find the message and raise it in its
        place, so every rank exits non-zero naming the rank that failed and why.
        """
        if self.world_size == 1:
            return fn()
        try:
            return fn()
        except BaseException as err:
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            peer = self._peer_error()
            if peer is not None and peer[0] != self.rank:
                raise RankFailed(f"rank {peer[0]} failed: {peer[1]}") from err
            message = " ".join((str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}").split())
            self._publish_error(message)
            raise RankFailed(f"rank {self.rank} failed: {message}") from err

    def _store(self):
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # no process group, or a torch without the accessor
            return None

    def _publish_error(self, message: str) -> None:
        store = self._store()
        if store is not None:
            with contextlib.suppress(Exception):  # the store may be gone with its host; the local error still stands
                store.set(f"{_ERROR_KEY}{self.rank}", message[:2000])

    def _peer_error(self, wait_s: float = 5.0) -> tuple[int, str] | None:
        """(rank, message) of the lowest rank that published an error, waiting up to `wait_s` for one to appear
        (this rank's collective can fail a moment before the failing rank has written its message)."""
        import time

        store = self._store()
        if store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                for r in range(self.world_size):
                    if r != self.rank and store.check([f"{_ERROR_KEY}{r}"]):
                        return r, store.get(f"{_ERROR_KEY}{r}").decode()
            except Exception:  # the store went away (its host rank ended)
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


class RankFailed(ValueError):
    """One rank of a distributed run failed; the message names it (a ValueError, so the CLI prints one line)."""


# ------------------------------------------------------------------------------------------------------- sharding
def _holds_fp32(module: nn.Module) -> bool:
    return any(name in FP32_PARAMS for name, _ in module.named_parameters(recurse=False))


def _with_params(modules) -> list[nn.Module]:
    return [m for m in modules if next(m.parameters(), None) is not None]


def shard_model(
    model: nn.Module,
    par: Parallel,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = False,
    activation_checkpointing: str | bool = "none",
) -> nn.Module:
    """Apply FSDP2 to a HybridLM in place (docs/distributed.md, "What is sharded", gives the groups) and return it.

    param_dtype: dtype of the gathered matrices (None: their own, float32). reshard_after_forward: free the layer
    groups after their forward and gather them again in the backward (less memory, one more all-gather per layer).
    activation_checkpointing: which sublayers recompute their activations in the backward instead of keeping them
    ("none", "mixer", "mlp", "all"; True: "all"), `activation_checkpointing.checkpoint_layer`.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hybrid_attention.training.activation_checkpointing import checkpoint_layer

    mesh = par.mesh
    low = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in model.layers:
        checkpoint_layer(layer, activation_checkpointing)
        mixer = layer.mixer
        # A mixer with float32 parameters of its own shares its submodules' group instead, its own group is float32.
        matrices = _with_params(mixer.children()) if _holds_fp32(mixer) else [mixer]
        fully_shard([*matrices, layer.mlp], mesh=mesh, mp_policy=low, reshard_after_forward=reshard_after_forward)
        if _holds_fp32(mixer):
            fully_shard(mixer, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    if model.lm_head.weight is not model.embed.weight:  # a tied table is read by the loss: it stays in the root
        fully_shard(model.embed, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=fp32)
    return model


def shard_for_training(model: nn.Module, par: Parallel, config, tokenizer, train_tokens: torch.Tensor) -> None:
    """Check that the run splits over the ranks, then shard `model` as `config` (a TrainConfig) asks.

    The global batch must divide evenly, and every rank must have built the same tokenizer and training split
    (each rank reads the data itself)."""
    from hybrid_attention.device import resolve_dtype

    if config.batch_size % par.world_size:
        raise ValueError(
            f"--batch-size {config.batch_size} is the global batch; it must be a multiple of the {par.world_size} "
            "processes, which each take an equal share"
        )
    digest = hashlib.sha256(tokenizer.to_json().encode() if tokenizer.kind == "bpe" else b"byte")
    digest.update(str(train_tokens.numel()).encode())
    par.check_same("tokenizer or training split", digest.hexdigest())
    dtype = resolve_dtype(par.device, config.dtype)  # autocast's dtype is the gathered matrices' dtype
    shard_model(
        model,
        par,
        param_dtype=None if dtype == torch.float32 else dtype,
        reshard_after_forward=config.fsdp_reshard_after_forward,
        activation_checkpointing=config.activation_checkpointing,
    )


# ----------------------------------------------------------------------------------------------------- optimizers
def build_optimizers(model: nn.Module, **kw) -> list[torch.optim.Optimizer]:
    """`optim.build_optimizers` for a sharded model: the same optimizers, Muon as `muon.GatheredMuon`."""
    from hybrid_attention.training.optim import build_optimizers as build

    optimizers = build(model, **kw)  # says so clearly when this torch has no Muon
    if kw.get("optimizer") != "muon":
        return optimizers
    from hybrid_attention.training.muon import (
        GatheredMuon,  # subclasses torch.optim.Muon: imported once it is known to exist
    )

    muon, *others = optimizers  # [Muon, AdamW]
    return [GatheredMuon(muon.param_groups, **muon.defaults), *others]


# ----------------------------------------------------------------------------------------------------- evaluation
class RankSlice(nn.Module):
    """Wraps a sharded model for `metrics.evaluate`: each rank runs its rows of the batch and the loss returned is
    the mean over all ranks, so the evaluation sees the global batch while each rank computes 1 / N of it."""

    def __init__(self, model: nn.Module, par: Parallel):
        super().__init__()
        self.model = model
        self.par = par

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kw):
        labels = None if labels is None else self.par.local_rows(labels)
        if kw.get("doc_starts") is not None:  # one entry per row (`packed_rows.PackedRows`)
            kw["doc_starts"] = self.par.local_rows(kw["doc_starts"])
        out = self.model(self.par.local_rows(input_ids), labels=labels, **kw)
        if out.loss is not None:
            out.loss = self.par.mean(out.loss)
        return out


def full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. the total norm `clip_grad_norm_` returns for sharded gradients) as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
