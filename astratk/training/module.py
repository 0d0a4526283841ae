"""`PolicyModule`: the trainer of one policy. It knows a model, a loss and an optimiser; nothing about Dask or envs.

One step: recompute token log-probs at the rollout temperature (ALGORITHMS §1: μ is the distribution sampled, so
log π comes from logits / T), call the loss, aggregate once (`astratk.training.aggregation`), step. The loss is any
`PolicyLoss` (DRPO by default), chosen by class path in the config.

Optional, all off by default (then the step is exactly the one above):
- **Proximal log-probs** π_old, when the loss (`needs_proximal`) or any correction asks: a no-grad forward at the
  current weights before the grad forward, i.e. at the start of the step's first (here: only) mini-batch. This is
  the proximal policy of ALGORITHMS §1: tokens carry per-token weight versions, so π at each token's exact rollout
  weights would take one forward per version and is impractical.
- **Mismatch corrections** (`corrections`, `astratk.losses.corrections`), in order: weights *= w, loss_mask *= keep.
- **Top-K log-probs** for a loss with `needs_topk`: log π at the engine's top-K ids, from the same logits.
- **KL to a frozen reference** (`kl_coef` > 0; the reference is `reference_path`, default the starting model, loaded
  only then) and an **entropy bonus** (`entropy_coef` > 0): added to the per-token losses under the loss's mask
  before aggregation; reported as `kl_ref_mean`, `entropy_mean`.
- **Batch statistics under DDP**: a loss with `batch_statistics` gets `reduce` = sum over ranks.

Example:
    >>> from astratk.losses.drpo import DRPO
    >>> from astratk.losses.corrections import TIS
    >>> module = PolicyModule("path/to/hf_model", loss=DRPO(delta=0.5), lr=1e-3,
    ...                       corrections=[TIS(cap=2.0)], kl_coef=0.01)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from astratk.contracts import LossInputs, PolicyLoss, TokenCorrection
from astratk.models.loading import load_causal_lm
from astratk.records import TrainBatch
from astratk.training._pl import pl
from astratk.training.aggregation import aggregate
from astratk.training.logprobs import PolicyForward, policy_forward, token_logprobs
from astratk.training.regularizers import check_kl_estimator
from astratk.training.step_inputs import (
    add_regularizers,
    apply_corrections,
    check_corrections,
    sum_over_ranks,
    topk_fields,
)


class PolicyModule(pl.LightningModule):
    def __init__(self, model_path: str, loss: PolicyLoss, *, policy_id: str = "main", lr: float = 1e-3,
                 weight_decay: float = 0.0, temperature: float = 1.0,
                 aggregation: str = "seq-mean-token-sum-norm", horizon: int | None = None,
                 corrections: list[TokenCorrection] | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                 reference_path: str | None = None, entropy_coef: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loss", "corrections"])
        if not (kl_coef >= 0 and entropy_coef >= 0):
            raise ValueError(f"kl_coef and entropy_coef must be >= 0 (0 turns the term off); got kl_coef={kl_coef}, "
                             f"entropy_coef={entropy_coef}")
        self.corrections, self.correction_names = check_corrections(corrections)
        self.kl_coef, self.kl_estimator = float(kl_coef), check_kl_estimator(kl_estimator)
        self.entropy_coef = float(entropy_coef)
        self.model = load_causal_lm(model_path, torch.float32)
        self.model.train()  # from_pretrained returns eval mode; Lightning warns about eval-mode modules in fit
        _disable_dropout(self.model)
        reference = None
        if self.kl_coef > 0:
            reference = load_causal_lm(reference_path or model_path, torch.float32).eval().requires_grad_(False)
        # Why not a submodule: it would be switched to train mode by fit, counted by Lightning's eval-mode warning,
        # saved in checkpoints and broadcast by DDP; it is frozen and loaded the same on every rank, so it is kept
        # outside the module tree and moved to the batch's device on first use (`_reference_on`).
        object.__setattr__(self, "reference", reference)
        self.loss = loss
        self.needs_proximal = bool(loss.needs_proximal or any(c.needs_proximal for c in self.corrections))
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
        proximal = self._no_grad_logprobs(self.model, batch) if self.needs_proximal else None  # [B, T], before the
        #   grad forward: the proximal policy (module docstring)
        topk_ids, topk_mu = topk_fields(batch, self.loss)  # [B, T, K] each, or None
        fwd = policy_forward(self.model, batch.input_ids, batch.attention_mask, self.temperature,
                             entropy=self.entropy_coef > 0, topk_ids=topk_ids)
        inputs = LossInputs(logprobs=fwd.logprobs, behavior_logprobs=batch.behavior_logprobs,
                            advantages=batch.advantages, loss_mask=batch.loss_mask, weights=batch.weights,
                            proximal_logprobs=proximal, topk_ids=topk_ids, topk_behavior_logprobs=topk_mu,
                            topk_logprobs=fwd.topk_logprobs, reduce=self._reduce())
        inputs, metrics = apply_corrections(self.corrections, self.correction_names, inputs)
        out = self.loss(inputs)
        token_losses, term_metrics = self._regularize(out.token_losses, out.mask, fwd, batch)
        loss = aggregate(token_losses, out.mask, self.aggregation, horizon=self.horizon)
        metrics.update({f"loss/{k}": v for k, v in out.metrics.items()})
        metrics.update(term_metrics)
        self._record(batch, loss, metrics)
        return loss

    def _no_grad_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(model, batch.input_ids, batch.attention_mask, self.temperature)  # [B, T]

    def _regularize(self, token_losses: torch.Tensor, mask: torch.Tensor, fwd: PolicyForward,
                    batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ref = None
        if self.reference is not None:
            ref = self._no_grad_logprobs(self._reference_on(batch.input_ids.device), batch)  # [B, T]
        return add_regularizers(token_losses, mask, fwd.logprobs, ref_logprobs=ref, kl_coef=self.kl_coef,
                                kl_estimator=self.kl_estimator, entropy=fwd.entropy, entropy_coef=self.entropy_coef)

    def _reference_on(self, device: torch.device) -> torch.nn.Module:
        if next(self.reference.parameters()).device != device:
            self.reference.to(device)
        return self.reference

    def _reduce(self) -> Any:
        """Sum over data-parallel ranks for losses with batch-wide statistics; None in a single process."""
        if not self.loss.batch_statistics or self._trainer is None or self.trainer.world_size <= 1:
            return None
        return sum_over_ranks(self.all_gather)

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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["astratk"] = {"policy_id": self.policy_id, "policy_version": self.policy_version}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("astratk", {})
        if saved.get("policy_id", self.policy_id) != self.policy_id:
            raise ValueError(f"checkpoint is of policy {saved['policy_id']!r}, not {self.policy_id!r}")
        self.policy_version = int(saved.get("policy_version", checkpoint.get("global_step", 0)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                                 betas=(0.9, 0.99))


def _disable_dropout(model: torch.nn.Module) -> None:
    """Ratios compare log-probs from separate forwards (engine, proximal, gradient); dropout noise would make r != 1
    on-policy and bias every trust region. HF attention reads its rate from the config at call time."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
