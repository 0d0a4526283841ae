"""`PolicyModule`: the trainer of one policy. It knows a model, a loss and an optimiser; nothing about Dask or envs.

One step: recompute token log-probs at the rollout temperature (ALGORITHMS §1: μ is the distribution sampled, so
log π comes from logits / T), call the loss, aggregate once (`astratk.training.aggregation`), step. The loss is any
`PolicyLoss` (DRPO by default), chosen by class path in the config.

Example:
    >>> from astratk.losses.drpo import DRPO
    >>> module = PolicyModule("path/to/hf_model", loss=DRPO(delta=0.5), lr=1e-3)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from astratk.contracts import LossInputs, PolicyLoss
from astratk.models.loading import load_causal_lm
from astratk.records import TrainBatch
from astratk.training.aggregation import aggregate
from astratk.training.logprobs import token_logprobs


class PolicyModule(pl.LightningModule):
    def __init__(self, model_path: str, loss: PolicyLoss, *, policy_id: str = "main", lr: float = 1e-3,
                 weight_decay: float = 0.0, temperature: float = 1.0,
                 aggregation: str = "seq-mean-token-sum-norm", horizon: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loss"])
        self.model = load_causal_lm(model_path, torch.float32)
        self.model.train()  # from_pretrained returns eval mode; Lightning warns about eval-mode modules in fit
        self.loss = loss
        self.policy_id = policy_id
        self.lr, self.weight_decay = lr, weight_decay
        self.temperature = temperature
        self.aggregation = loss.required_aggregation or aggregation
        self.horizon = horizon
        self.policy_version = 0  # the version of the weights being trained from; set by the publish callback
        self.step_metrics: dict[str, float] = {}  # last step's metrics, read by callbacks (progress, recorder)

    def weights(self) -> dict[str, torch.Tensor]:
        """The HF model's state (keys as in the saved model directory), detached copies for publication."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def training_step(self, batch: TrainBatch, batch_idx: int) -> torch.Tensor:
        logprobs = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.temperature)  # [B, T]
        out = self.loss(LossInputs(logprobs=logprobs, behavior_logprobs=batch.behavior_logprobs,
                                   advantages=batch.advantages, loss_mask=batch.loss_mask, weights=batch.weights))
        loss = aggregate(out.token_losses, out.mask, self.aggregation, horizon=self.horizon)
        self._record(batch, loss, out.metrics)
        return loss

    def _record(self, batch: TrainBatch, loss: torch.Tensor, loss_metrics: dict[str, Any]) -> None:
        mask = batch.loss_mask
        n_tokens = mask.sum().clamp_min(1)
        staleness = ((self.policy_version - batch.versions).clamp_min(0) * mask).sum() / n_tokens
        prefix = f"train/{self.policy_id}/"
        metrics = {
            "loss": loss.detach(),
            "reward_mean": batch.rewards.mean() if batch.rewards is not None else torch.tensor(float("nan")),
            "sequences": torch.tensor(float(len(batch))),
            "groups": torch.tensor(float(batch.n_groups)),
            "completion_tokens_mean": mask.sum(1).mean(),
            "staleness_mean": staleness,
            "staleness_max": ((self.policy_version - batch.versions) * mask).max().clamp_min(0),
            "policy_version": torch.tensor(float(self.policy_version)),
            "behavior_version_min": batch.versions.masked_fill(mask == 0, 2**62).min().float(),
            "behavior_version_max": batch.versions.masked_fill(mask == 0, -1).max().float(),
        }
        metrics.update({f"loss/{k}": v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                        for k, v in loss_metrics.items()})
        self.step_metrics = {prefix + k: float(v) for k, v in metrics.items()}
        self.log_dict({prefix + k: v for k, v in metrics.items()}, batch_size=len(batch), on_step=True,
                      on_epoch=False, prog_bar=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                                 betas=(0.9, 0.99))
