"""What a `PolicyModule` step reports: `train/<policy>/...` metrics (loss, rewards, staleness, versions, what the step
pieces measured) logged through Lightning and kept in `step_metrics` for the callbacks, and |π - μ| of the sampled
tokens. A new per-step number is returned in a step piece's metrics, or added to `_record` when it is the batch's.
Mixed into `PolicyModule` (`astratk.training.module`).
"""

from __future__ import annotations

from typing import Any

import torch

from astratk.records import TrainBatch


class StepMetrics:
    """`PolicyModule`'s step record; `policy_id` and `policy_version` are set by its `__init__` and callbacks."""

    def _record(self, batch: TrainBatch, loss: torch.Tensor, extra_metrics: dict[str, Any]) -> None:
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
        roles = sorted(set(batch.roles))
        if batch.rewards is not None and roles != ["policy"]:  # workflows: one reward curve per role
            for role in roles:
                rows = torch.tensor([r == role for r in batch.roles])
                metrics[f"reward_mean_{role}"] = batch.rewards[rows].mean()
        metrics.update({k: v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                        for k, v in extra_metrics.items()})
        self.step_metrics = {prefix + k: float(v) for k, v in metrics.items()}
        self.log_dict({prefix + k: v for k, v in metrics.items()}, batch_size=len(batch), on_step=True,
                      on_epoch=False, prog_bar=False)


def pi_mu(logprobs: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """|pi - mu| of the sampled tokens (probabilities at the rollout temperature; mean and max over the completion
    tokens), whatever the loss: the training-inference mismatch plus the policy's drift since each token's behaviour
    version (the mismatch alone at staleness 0)."""
    with torch.no_grad():
        on = mask > 0
        if not on.any():
            return {}
        diff = (logprobs.detach().exp() - behavior.exp()).abs()[on]
        return {"pi_mu_abs_mean": diff.mean(), "pi_mu_abs_max": diff.max()}
