"""One optimizer step of training: every micro-batch's forward and backward, clipping, the optimizer steps and the
zeroing of the gradients, run eagerly or captured once in a CUDA graph and replayed (docs/training.md, "One step", "CUDA
graphs").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable

import torch

from hybrid_attention.ops.cuda_graph import CapturedGraph
from hybrid_attention.training.distributed import full

ADAM = (torch.optim.Adam, torch.optim.AdamW)


class TrainStep:
    """One optimizer step over `grad_accum` micro-batches: `step(batches)` -> (loss_sum, grad_norm).

    Args:
        loss_of: ids [B, T] -> the scalar mean loss of one micro-batch (run under `autocast`).
        params: the parameters whose gradients are clipped (every parameter the optimizers update).
        optimizers: stepped in order after the clipping; with `cuda_graph`, torch.optim.Adam, AdamW or
            `muon.StackedMuon`.
        grad_accum: micro-batches per step; each loss is divided by it, so the gradients are those of their mean.
        clip: the gradient-norm clip (math.inf: measure the norm, clip nothing); None: no norm at all.
        autocast: a context factory around each forward (e.g. `device.autocast_for(...)`).
        cuda_graph: capture the step in a CUDA graph at the first call and replay it (CUDA, one process).
        warmup_steps: eager steps on a side stream before the capture (undone afterwards).

    The step is the same in both modes: per micro-batch `loss_of(ids) / grad_accum` and its backward, then
    `clip_grad_norm_`, each optimizer's `step()`, and the gradients set to None (eager) or overwritten by the next
    replay's first backward (graph). The tensors a replay returns live in static buffers that the next `step` call
    overwrites: read them (or clone them) before calling `step` again.
    """

    def __init__(
        self,
        loss_of: Callable[[torch.Tensor], torch.Tensor],
        params: Iterable[torch.nn.Parameter],
        optimizers: list[torch.optim.Optimizer],
        *,
        grad_accum: int = 1,
        clip: float | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        cuda_graph: bool = False,
        warmup_steps: int = 3,
    ):
        self.params = list(params)
        if not self.params:
            raise ValueError("TrainStep: expected at least one parameter")
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"TrainStep: grad_accum must be a positive integer, got {grad_accum!r}")
        if clip is not None and not clip >= 0:
            raise ValueError(f"TrainStep: clip must be >= 0 (math.inf: no clipping) or None, got {clip}")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"TrainStep: warmup_steps must be a positive integer, got {warmup_steps!r}")
        self.device = self.params[0].device
        if cuda_graph:
            _check_capturable(self.params, optimizers)
        self.loss_of, self.optimizers, self.grad_accum, self.clip = loss_of, list(optimizers), grad_accum, clip
        self.autocast, self.cuda_graph, self.warmup_steps = autocast, cuda_graph, warmup_steps
        self.graph: CapturedGraph | None = None
        self.batches: torch.Tensor | None = None  # static input of the graph
        self.loss_sum: torch.Tensor | None = None  # static outputs of the graph
        self.grad_norm: torch.Tensor | None = None
        self._lrs: list[tuple[torch.Tensor, dict]] = []  # (device learning rate the graph reads, its param group)
        optimized = {id(q) for opt in self.optimizers for g in opt.param_groups for q in g["params"]}
        self._unoptimized = [p for p in self.params if id(p) not in optimized]  # clipped: their gradients reset too

    def step(self, batches: torch.Tensor, extras: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """batches [grad_accum, B, T] token ids -> (loss_sum, grad_norm), detached scalar device tensors. `extras`:
        one more argument of `loss_of` per micro-batch (e.g. where its documents start; eager steps only).

        loss_sum is the sum of the micro-batches' `loss / grad_accum` (the step's mean loss), grad_norm the total
        gradient norm before clipping (None when `clip` is None). With a CUDA graph both are static buffers that
        the next call overwrites; every call must pass the shape and dtype of the first.
        """
        if batches.dim() < 1 or batches.shape[0] != self.grad_accum:
            raise ValueError(
                f"TrainStep.step: expected batches [grad_accum={self.grad_accum}, ...], got {tuple(batches.shape)}"
            )
        if extras is not None and (self.cuda_graph or len(extras) != self.grad_accum):
            raise ValueError(
                f"TrainStep.step: extras take an eager step and one item per micro-batch ({self.grad_accum})"
            )
        if not self.cuda_graph:
            out = self._accumulate_and_step(batches, extras)
            self._zero_grad()
            return out
        if self.graph is None:
            self._capture(batches)
        elif batches.shape != self.batches.shape or batches.dtype != self.batches.dtype:
            raise ValueError(
                f"TrainStep.step: the graph was captured for {self.batches.dtype} batches of shape "
                f"{tuple(self.batches.shape)}, got {batches.dtype} {tuple(batches.shape)}"
            )
        self.batches.copy_(batches)
        for lr, group in self._lrs:  # the scheduler's value for this step
            lr.fill_(group["lr"])
        self.graph.replay()
        return self.loss_sum, self.grad_norm

    # ------------------------------------------------------------------------------------------------- the step
    def _accumulate_and_step(self, batches: torch.Tensor, extras=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step itself, eager or under capture (gradients accumulate into whatever .grad holds)."""
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.grad_accum):
            args = () if extras is None else (extras[micro],)
            with self.autocast():
                loss = self.loss_of(batches[micro], *args) / self.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = None
        if self.clip is not None:
            grad_norm = full(torch.nn.utils.clip_grad_norm_(self.params, self.clip)).detach()  # no host sync
        for opt in self.optimizers:
            opt.step()
        return loss_sum, grad_norm

    def _zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for p in self._unoptimized:
            p.grad = None

    # ------------------------------------------------------------------------------------------------- capture
    def _capture(self, batches: torch.Tensor) -> None:
        self.batches = torch.empty_like(batches, device=self.device).copy_(batches)
        saved = _Snapshot(self.params, self.optimizers)
        groups = [g for opt in self.optimizers for g in opt.param_groups]
        before = [(g["lr"], g.get("capturable")) for g in groups]
        self._lrs = [(torch.tensor(float(g["lr"]), device=self.device), g) for g in groups]
        current = torch.cuda.current_stream(self.device)
        try:
            for lr, group in self._lrs:  # what capture records: the optimizers read the device tensor
                group["lr"] = lr
                if "capturable" in group:  # Adam's flag for a device learning rate (StackedMuon takes it as it is)
                    group["capturable"] = True

            def step():
                self._zero_grad()  # sets .grad to None: host work only, nothing the graph records
                return self._accumulate_and_step(self.batches)

            def reset():
                self._zero_grad()
                saved.restore()

            # The first backward allocates the gradients in the graph's pool; each replay's first backward overwrites
            # them, so the graph needs no zeroing (and .grad keeps pointing at them between replays).
            self.graph = CapturedGraph(
                step, self.device, warmup_steps=self.warmup_steps, reset=reset, warmup_context=_quiet_capturable
            )
            self.loss_sum, self.grad_norm = self.graph.output
        except BaseException:
            current.synchronize()
            self._zero_grad()
            saved.restore()  # as before the call: no step was taken
            raise
        finally:
            for group, (lr, capturable) in zip(groups, before, strict=True):
                group["lr"] = lr
                if "capturable" in group:
                    group["capturable"] = capturable


@contextlib.contextmanager
def _quiet_capturable():
    """The warm-up runs uncaptured with capturable optimizers, about which they warn."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        yield


def _check_capturable(params: list[torch.Tensor], optimizers) -> None:
    # Adam and AdamW take a device learning rate with capturable=True; muon.StackedMuon says so with `device_lr`.
    wrong = [type(o).__name__ for o in optimizers if not (isinstance(o, ADAM) or getattr(o, "device_lr", False))]
    if wrong:
        raise ValueError(
            f"TrainStep: cuda_graph=True supports torch.optim.Adam, AdamW and StackedMuon only, got {', '.join(wrong)}"
        )
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed: nothing is sharded
        DTensor = ()
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError("TrainStep: cuda_graph=True runs in one process; these parameters are sharded (DTensor)")
    if params[0].device.type != "cuda":
        raise ValueError(f"TrainStep: cuda_graph=True needs parameters on a CUDA device, got {params[0].device}")


class _Snapshot:
    """Copies of the parameters and of the optimizers' state tensors, to undo the warm-up steps. They are kept in host
    memory: on the device they would add the size of the parameters and of the optimizer state to the run's peak."""

    @torch.no_grad()
    def __init__(self, params: list[torch.Tensor], optimizers):
        grouped = [q for opt in optimizers for g in opt.param_groups for q in g["params"]]
        params = {id(p): p for p in [*params, *grouped]}
        host = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
        self.tensors = [(p, host(p)) for p in params.values()]
        self.tensors += [
            (t, host(t)) for opt in optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        ]
        self.known = [(opt, {id(p) for p in opt.state}) for opt in optimizers]

    @torch.no_grad()
    def restore(self) -> None:
        for t, copy in self.tensors:
            t.copy_(copy)
        for opt, known in self.known:  # state the warm-up created: zeros, as Adam makes it for a fresh parameter
            for p, state in opt.state.items():
                if id(p) not in known:
                    for t in state.values():
                        if torch.is_tensor(t):
                            t.zero_()
