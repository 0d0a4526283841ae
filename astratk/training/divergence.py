"""`DivergenceGuard`: skip the optimiser steps that would wreck the policy, and stop a run that keeps producing them.

A step is skipped when its loss or its gradient norm is not finite, or when its gradient norm is above `spike_factor`
x the median norm of the last `window` steps the guard accepted (looked for once `MIN_HISTORY` are known).
Skipping means no weight update at all: the gradients are dropped (set to None) in Lightning's
`on_before_optimizer_step`, after the backward and before clipping and the optimiser, so AdamW leaves every parameter
and its moments alone (no weight decay either). The step still counts (`global_step`: the data stream hands one batch
per step), and `PolicyModule.step_skipped` tells the publisher not to publish it (`astratk.training.publish`). Every
step's metrics carry `train/<policy>/grad_norm` (before clipping) and `train/<policy>/skipped_steps` (so far);
`max_skips` skipped steps in a row stop the run (`trainer.should_stop`), and the recorder keeps the reason in words
(`StepRecorder.stop_reason`), which the run's summary and the CLI report.

Why there: the gradient norm exists only after the backward, and Lightning 2.6's automatic optimisation has no other
clean skip (`training_step` returning None is refused under DDP, and it would not cover micro-batches already
back-propagated inside the step). Dropping the gradients leaves the optimiser, clipping, DDP and FSDP paths as they
are.

Data parallelism: every rank sees the same loss (the step's, gathered over ranks) and the same norm (DDP all-reduces
the gradients; under FSDP the norm is reduced over every shard, `astratk.training.sharding.clip_gradients`), so every
rank decides alike. With fp16 mixed precision the loss scaler skips non-finite steps itself (its first steps often
are, while it calibrates the scale): only spikes count then.

Example:
    >>> from astratk.spec import DivergenceSpec
    >>> guard = DivergenceGuard(DivergenceSpec(spike_factor=10.0, max_skips=2), "main")
    >>> [guard.check(1.0, n) for n in [1.0] * 10 + [50.0, float("nan")]][-2:]
    ['gradient norm 50 is 50x the running median 1 (trainer.divergence.spike_factor 10)', 'gradient norm is nan']
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from astratk.spec import DivergenceSpec
from astratk.training._pl import pl

# accepted steps needed before a norm can be called a spike (a median of fewer says little)
MIN_HISTORY = 10


class DivergenceGuard(pl.Callback):
    def __init__(self, spec: DivergenceSpec, policy_id: str, recorder: Any = None,
                 printer: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.policy_id = policy_id
        self.recorder = recorder  # gets `stop_reason` when the guard stops the run
        self.printer = printer
        self.history: deque[float] = deque(maxlen=spec.window)  # accepted steps' gradient norms
        self.skipped = 0  # steps skipped so far
        self.in_a_row = 0
        self.stop_reason: str | None = None

    def check(self, loss: float, grad_norm: float, scaler: bool = False) -> str | None:
        """Why a step with this loss and gradient norm must be skipped, or None (the norm then joins the running
        median's window). `scaler`: fp16's loss scaler handles non-finite values itself."""
        if not scaler:
            if not math.isfinite(loss):
                return f"loss is {loss}"
            if not math.isfinite(grad_norm):
                return f"gradient norm is {grad_norm}"
        elif not math.isfinite(grad_norm):
            return None
        f = self.spec.spike_factor
        if f is not None and len(self.history) >= min(MIN_HISTORY, self.spec.window):
            median = statistics.median(self.history)
            if median > 0 and grad_norm > f * median:
                return (f"gradient norm {grad_norm:.3g} is {grad_norm / median:.0f}x the running median {median:.3g} "
                        f"(trainer.divergence.spike_factor {f:g})")
        self.history.append(grad_norm)
        return None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        prefix = f"train/{self.policy_id}/"
        metrics = pl_module.step_metrics
        norm = _grad_norm(pl_module, optimizer)
        loss = metrics.get(prefix + "loss", 0.0)
        reason = self.check(loss, norm, scaler=getattr(trainer.precision_plugin, "scaler", None) is not None)
        if reason is None:
            self.in_a_row = 0
        else:
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without gradients: no update at all
            pl_module.step_skipped = True
            self.skipped += 1
            self.in_a_row += 1
            if self.printer is not None and trainer.is_global_zero:
                self.printer(f"{self.policy_id} step {trainer.global_step} skipped (trainer.divergence): {reason}")
            if self.in_a_row >= self.spec.max_skips:
                self._stop(trainer, pl_module, reason)
        metrics[prefix + "grad_norm"] = norm
        metrics[prefix + "skipped_steps"] = float(self.skipped)

    def _stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> None:
        step = trainer.global_step
        lr = getattr(pl_module, "lr", None)
        self.stop_reason = (
            f"training of policy {self.policy_id!r} diverged: {self.in_a_row} optimiser steps in a row were skipped "
            f"(steps {step - self.in_a_row + 1}..{step}; the last: {reason}); lower trainer.lr"
            + (f" (now {lr:g})" if isinstance(lr, float | int) else "")
            + ", or raise trainer.divergence.max_skips or spike_factor if these steps were sound")
        if self.recorder is not None:
            self.recorder.stop_reason = self.stop_reason
        trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = deque(state_dict["history"], maxlen=self.spec.window)
        self.skipped, self.in_a_row = int(state_dict["skipped"]), int(state_dict["in_a_row"])


def _grad_norm(pl_module: Any, optimizer: torch.optim.Optimizer) -> float:
    """The total 2-norm of the step's gradients, before clipping: over every shard under FSDP (a collective every rank
    joins; scaling by 1 leaves the gradients as they are), else over the optimiser's parameters (identical on every
    DDP rank after the all-reduce)."""
    sharded = getattr(pl_module, "_sharded_root", None)
    root = sharded() if callable(sharded) else None
    if root is not None:
        from astratk.training.sharding import clip_gradients

        return float(clip_gradients(root, math.inf))
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False))
