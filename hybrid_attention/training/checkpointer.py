"""A run's checkpoints as the loop sees them: commit one after a step unless the run has diverged, and say which one
the run keeps."""

from __future__ import annotations

from hybrid_attention.runs import checkpoint as ckpt
from hybrid_attention.runs import dist_checkpoint


class TrainingDiverged(ValueError):
    """The loss, the gradient norm, the weights or the validation loss became NaN or infinite; nothing from that
    point on was saved."""


class Checkpointer:
    def __init__(self, p, par, config):
        """p: the run's `prepare.Prepared`; config: its `TrainConfig` (the rates the divergence message names)."""
        self.run_dir, self.par, self.model = p.run_dir, par, p.model
        self.optimizers, self.schedulers = p.optimizers, p.schedulers
        self.saved_step = p.step  # the step of the checkpoint the run keeps (0: none)
        self.lr, self.weight_decay = config.lr, config.weight_decay

    def kept(self) -> str:
        return f"its checkpoint of step {self.saved_step}" if self.saved_step else "no checkpoint"

    def save(self, step: int, *, validation_finite: bool = True) -> None:
        """Commit a checkpoint of `step` (a collective call under torchrun), unless its weights or its validation
        loss are no longer finite: then raise TrainingDiverged, keeping the last good checkpoint."""
        bad = ckpt.nonfinite_parameters(self.model)
        if self.par.maxima(float(bool(bad) or not validation_finite))[0]:
            what = (
                f"the weights hold NaN or infinite values ({', '.join(bad[:3])})"
                if bad
                else "the validation loss is not finite"
            )
            raise TrainingDiverged(
                f"training diverged: after step {step} {what}; nothing from it was saved, {self.run_dir} keeps "
                f"{self.kept()}; start a new run with a lower --lr or --weight-decay (this one has {self.lr:g}, "
                f"{self.weight_decay:g})"
            )
        dist_checkpoint.save_training(self.run_dir, self.par, self.model, self.optimizers, self.schedulers, step)
        self.saved_step = step

    def diverged(self, step: int, lr: float) -> TrainingDiverged:
        """The error for a non-finite loss or gradient norm first seen at `step` (learning rate `lr`)."""
        return TrainingDiverged(
            f"training diverged: the loss or the gradient norm is not finite at step {step} (learning rate {lr:.3g}); "
            f"nothing from it was saved, {self.run_dir} keeps {self.kept()}; start a new run with a lower --lr (this "
            f"one has {self.lr:g})"
        )
