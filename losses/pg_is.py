"""PG-IS: importance-sampled policy gradient with no trust region.

Per token, with r = pi / mu anchored on the rollout engine's log-probs (log r clamped to +-20):

    l_t = -A_t r_t          gradient coefficient on A grad log pi: c_t = r_t

It is the baseline every trust region is measured against: DPPO (arXiv 2602.04879, §5) reports that it drifts (mean
|pi - mu| grows) and eventually collapses even at lr 1e-6. No configuration.
"""

from __future__ import annotations

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import ratio_metrics, tokens


class PGIS(PolicyLoss):
    """Plain importance-sampled policy gradient, -A r per token.

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()  # mu = 1 below, so r = pi
        >>> out = PGIS()(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 2),
        ...                         advantages=torch.tensor([[1.0, -2.0]]), loss_mask=torch.ones(1, 2)))
        >>> out.token_losses.tolist()  # -1 * 1.5, 2 * 0.5
        [[-1.5, 1.0]]
    """

    def __repr__(self) -> str:
        return "PGIS()"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        token_losses = -adv * r * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        metrics = {
            **ratio_metrics(r, log_r, mask, valid),
        }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
