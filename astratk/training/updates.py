"""Several optimiser updates on one data-layer batch (`updates_per_batch`, PPO's mini-batches), inside one
`training_step` of a `PolicyModule`: the batch's rows cut into slices, each slice an update with what Lightning does
around its own (DDP averaging, the callbacks' `on_before_optimizer_step`, clipping). Versions and `global_step` still
count batches. Mixed into `PolicyModule` (`astratk.training.module`).
"""

from __future__ import annotations

from typing import Any

import torch

from astratk.records import TrainBatch
from astratk.training.collate import select_rows
from astratk.training.sharding import max_over_ranks


class BatchUpdates:
    """`PolicyModule`'s mini-batch updates; the step they repeat is `MicroBatchSteps._step`."""

    def _mini_batch_updates(self, batch: TrainBatch) -> torch.Tensor:
        """`updates_per_batch` = k > 1 optimiser updates on one data-layer batch (PPO's mini-batches).

        The rows are cut into k contiguous slices (advantages are per sample, already computed by the data layer, so
        a group may straddle two slices). The proximal log-probs, when the loss or a correction needs them, come from
        one no-grad forward of every slice *before* the first update: pi_prox is the policy the batch started from,
        and pi / pi_prox drifts from 1 on the later slices, where a trust region on it binds. Slices 1..k-1 are
        updated here: backward, gradients averaged over ranks under DDP, the callbacks' `on_before_optimizer_step`
        (the divergence guard may skip one), clipping as Lightning clips, the optimiser step. The last slice's loss
        is returned, so Lightning updates it like any step's. The recorded metrics are the mean over the k updates.
        """
        k = min(self.updates_per_batch, len(batch))
        if self._distributed():  # every rank makes the same number of updates (each one all-reduces gradients)
            k = -max_over_ranks(-k, self.trainer.strategy)
        if self._sharded_root() is not None:
            raise ValueError("trainer.updates_per_batch > 1 is not supported under FSDP (each update would need its "
                             "own sharded optimiser step inside one Lightning step); use strategy ddp or one update")
        if self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError("trainer.updates_per_batch > 1 is not supported with fp16 loss scaling (precision "
                             "16-mixed); use bf16-mixed or 32-true")
        slices = [select_rows(batch, rows) for rows in torch.arange(len(batch)).tensor_split(k)]
        proximal: list[torch.Tensor | None] = [None] * k
        if self.needs_proximal:
            proximal = [self._no_grad_logprobs(self.model, part) for part in slices]  # [b, t] each, at the start
        self._updated_earlier = False
        records: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for part, prox in zip(slices[:-1], proximal[:-1], strict=True):
            loss, metrics = self._step(part, prox)
            self._backward(loss)
            self._update()
            records.append((self._loss_value(loss), metrics))
        loss, metrics = self._step(slices[-1], proximal[-1])
        records.append((self._loss_value(loss), metrics))
        mean = {key: sum(float(m[key]) for _, m in records if key in m) / sum(key in m for _, m in records)
                for key in dict.fromkeys(key for _, m in records for key in m)}
        mean["updates"] = float(k)
        self._record(batch, torch.stack([v.detach().float() for v, _ in records]).mean(), mean)
        return loss

    def _update(self) -> None:
        """One optimiser update inside `training_step` (mini-batches), with what Lightning does around its own:
        the gradients averaged over ranks (DDP; inside the step's forward the reducer does not), the callbacks'
        `on_before_optimizer_step` (the divergence guard), clipping, the step, zeroed gradients."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._trainer is None:
            raise RuntimeError("updates_per_batch > 1 needs the module attached to a Lightning Trainer")
        trainer = self.trainer
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(trainer.world_size)
        optimizer = self.optimizers()
        raw = getattr(optimizer, "optimizer", optimizer)
        self.step_skipped = False
        for cb in trainer.callbacks:
            cb.on_before_optimizer_step(trainer, self, raw)
        skipped, self.step_skipped = self.step_skipped, False
        if not skipped:
            self.configure_gradient_clipping(raw, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            raw.step()
            self._updated_earlier = True
        raw.zero_grad(set_to_none=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Mini-batches: the weights already changed in this step when an earlier update went through, so the step
        is published even if the guard skips its last update."""
        if self._updated_earlier:
            self.step_skipped = False
            self._updated_earlier = False
