"""From a forward's log-probs to the loss a `PolicyModule` back-propagates: the corrections, the `PolicyLoss`, the
regularisers (KL, entropy), then one aggregation whose denominators count every data-parallel rank (the module's
docstring, "Data parallel", says why). A new term on the per-token losses goes into `_loss_terms`, before the
aggregation. Mixed into `PolicyModule` (`astratk.training.module`).
"""

from __future__ import annotations

from typing import Any

import torch

from astratk.contracts import LossInputs
from astratk.records import TrainBatch
from astratk.training.aggregation import aggregate
from astratk.training.logprobs import PolicyForward
from astratk.training.step_inputs import add_regularizers, apply_corrections, sum_over_ranks, topk_fields
from astratk.training.step_metrics import pi_mu


class LossTerms:
    """`PolicyModule`'s loss and its aggregation; the loss, corrections and coefficients are set by its `__init__`."""

    def _loss_terms(self, batch: TrainBatch, fwd: PolicyForward, proximal: torch.Tensor | None,
                    ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Corrections, the loss and the regularisers: (token losses [B, T], effective mask [B, T], metrics)."""
        topk_ids, topk_mu = topk_fields(batch, self.loss)  # [B, T, K] each, or None
        inputs = LossInputs(logprobs=fwd.logprobs, behavior_logprobs=batch.behavior_logprobs,
                            advantages=batch.advantages, loss_mask=batch.loss_mask, weights=batch.weights,
                            proximal_logprobs=proximal, topk_ids=topk_ids, topk_behavior_logprobs=topk_mu,
                            topk_logprobs=fwd.topk_logprobs,
                            sampled_ids=None if topk_ids is None else batch.input_ids[:, 1:], reduce=self._reduce())
        inputs, metrics = apply_corrections(self.corrections, self.correction_names, inputs)
        out = self.loss(inputs)
        token_losses, term_metrics = add_regularizers(out.token_losses, out.mask, fwd.logprobs, ref_logprobs=ref,
                                                      kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
                                                      entropy=fwd.entropy, entropy_coef=self.entropy_coef)
        metrics.update({f"loss/{k}": v for k, v in out.metrics.items()})
        metrics.update(term_metrics)
        metrics.update(pi_mu(fwd.logprobs, batch.behavior_logprobs, batch.loss_mask))
        return token_losses, out.mask, metrics

    def _aggregate(self, token_losses: torch.Tensor, mask: torch.Tensor,
                   counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The loss this process back-propagates for these token losses (`astratk.training.module`, "Data parallel").

        `counts` (tokens, sequences) are the denominators; None: this batch's, summed over ranks under DDP. In a
        single process without `counts` this is `aggregate` itself, bit for bit."""
        if counts is None and not self._distributed():
            return aggregate(token_losses, mask, self.aggregation, horizon=self.horizon)
        tokens, seqs = counts if counts is not None else self._counts(mask)
        world = self.trainer.world_size if self._distributed() else 1
        return world * aggregate(token_losses, mask, self.aggregation, horizon=self.horizon, global_tokens=tokens,
                                 global_seqs=seqs)

    def _counts(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask tokens, sequences) of this batch, summed over ranks under DDP: the aggregation denominators."""
        local = torch.stack([mask.detach().sum(dtype=torch.float64), torch.tensor(float(mask.shape[0]),
                                                                                  dtype=torch.float64,
                                                                                  device=mask.device)])
        total = sum_over_ranks(self.all_gather)(local) if self._distributed() else local
        return total[0], total[1]

    def _loss_value(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss for the metrics: the global batch's under DDP (each rank returns world x its share)."""
        if not self._distributed():
            return loss.detach()
        return sum_over_ranks(self.all_gather)(loss.detach() / self.trainer.world_size)

    def _distributed(self) -> bool:
        return self._trainer is not None and self.trainer.world_size > 1

    def _reduce(self) -> Any:
        """Sum over data-parallel ranks for losses with batch-wide statistics; None in a single process."""
        if not self.loss.batch_statistics or not self._distributed():
            return None
        return sum_over_ranks(self.all_gather)
