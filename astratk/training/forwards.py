"""The forwards of a `PolicyModule` step: log π (with entropy and top-K log π when asked) at the rollout temperature,
each group's shared prompt run once when `share_prompts` holds (checked once against the padded forward), and the
no-grad forwards of the proximal policy and the frozen KL reference. A new forward output goes into
`astratk.training.logprobs` and is asked for here. Mixed into `PolicyModule` (`astratk.training.module`).
"""

from __future__ import annotations

import warnings

import torch

from astratk.records import TrainBatch
from astratk.training.collate import select_rows
from astratk.training.logprobs import PolicyForward, policy_forward, token_logprobs
from astratk.training.prefix import PrefixPlan
from astratk.training.prefix import plan as prefix_plan
from astratk.training.step_inputs import topk_fields


class PolicyForwards:
    """`PolicyModule`'s forwards; `model`, `reference`, `temperature` and `share_prompts` are set by its `__init__`."""

    def _policy_forward(self, batch: TrainBatch) -> PolicyForward:
        topk_ids, _ = topk_fields(batch, self.loss)  # [B, T, K], or None
        return policy_forward(self.model, batch.input_ids, batch.attention_mask, self.temperature,
                              entropy=self.entropy_coef > 0, topk_ids=topk_ids, prefixes=self._prefixes(batch))

    def _prefixes(self, batch: TrainBatch) -> PrefixPlan | None:
        """The shared-prompt plan for `batch`, or None for the plain padded forward: sharing is off, the batch has
        nothing worth sharing, the model is sharded (FSDP gathers per forward), or the first check failed.

        The first batch that shares checks it once: log π of a few rows by both forwards, no grad. A model whose
        cache cannot be split per row (or that computes a prompt differently when continued from a cache) falls back
        to the padded forward for the rest of the run, with a warning that names the difference."""
        if self.share_prompts is False or self._sharded_root() is not None:
            return None
        plan = prefix_plan(batch.input_ids, batch.attention_mask, batch.loss_mask)
        if plan is not None and self.share_prompts is None:
            self.share_prompts = self._check_prefixes(batch, plan)
        return plan if self.share_prompts else None

    def _check_prefixes(self, batch: TrainBatch, plan: PrefixPlan) -> bool:
        rows = torch.nonzero(plan.owner == plan.owner[0]).flatten()[:3]  # one prompt's rows: they share it
        part = select_rows(batch, rows)
        small = prefix_plan(part.input_ids, part.attention_mask, part.loss_mask, min_saving=0.0)
        if small is None:
            return True  # nothing to compare on this batch: the next batch's plan is checked instead
        try:
            with torch.no_grad():
                plain = token_logprobs(self.model, part.input_ids, part.attention_mask, self.temperature)
                shared = token_logprobs(self.model, part.input_ids, part.attention_mask, self.temperature, small)
            trained = part.loss_mask > 0
            diff = float((plain - shared)[trained].abs().max())
        except Exception as e:  # noqa: BLE001 - any model whose cache cannot be split this way
            warnings.warn(f"trainer.share_prompts: {type(self.model).__name__} cannot continue a forward from a "
                          f"per-row prompt cache ({e!r}); using the padded forward", stacklevel=2)
            return False
        low = (next(self.model.parameters()).dtype != torch.float32
               or torch.is_autocast_enabled(part.input_ids.device.type))
        tolerance = 5e-2 if low else 1e-3  # bf16 arithmetic rounds the two orders of summation apart
        if low and not diff <= tolerance:
            # in bf16 the padded forward moves as much with a batch's layout: each row run alone sets the noise
            # floor that the shared forward is held to (measured on SmolLM2 with bf16-mixed: 0.18 both ways)
            tolerance = max(tolerance, 2 * self._layout_noise(part, plain))
        if not diff <= tolerance:
            warnings.warn(f"trainer.share_prompts: log-probs with the shared-prompt forward differ from the padded "
                          f"forward by {diff:.2e} (> {tolerance:g}) for {type(self.model).__name__}; using the padded "
                          "forward", stacklevel=2)
            return False
        return True

    def _layout_noise(self, part: TrainBatch, padded: torch.Tensor) -> float:
        """The largest change of a trained token's log-prob between the padded forward of `part` and each row run
        alone (its own length, no padding): how far two layouts of the same rows drift apart at this precision."""
        worst = 0.0
        with torch.no_grad():
            for i in range(part.input_ids.shape[0]):
                n = int(part.attention_mask[i].sum())
                alone = token_logprobs(self.model, part.input_ids[i:i + 1, :n], part.attention_mask[i:i + 1, :n],
                                       self.temperature)[0]  # [n - 1]
                trained = part.loss_mask[i, :n - 1] > 0
                if trained.any():
                    worst = max(worst, float((alone - padded[i, :n - 1])[trained].abs().max()))
        return worst

    def _no_grad_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(model, batch.input_ids, batch.attention_mask, self.temperature,
                                  self._prefixes(batch))  # [B, T]

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """log π_ref [B, T] (no grad) when the KL term is on, else None. With LoRA and no `reference_path`, the
        reference is the base model: this model with its adapters switched off."""
        if self.reference is None and self.kl_coef > 0 and self.lora is not None:
            with self.model.disable_adapter():
                return self._no_grad_logprobs(self.model, batch)
        if self.reference is None:
            return None
        return self._no_grad_logprobs(self._reference_on(batch.input_ids.device), batch)

    def _reference_on(self, device: torch.device) -> torch.nn.Module:
        if next(self.reference.parameters()).device != device:
            self.reference.to(device)
        return self.reference
