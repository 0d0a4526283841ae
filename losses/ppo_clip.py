"""PPO / GRPO clipped surrogate, rollout-anchored (DAPO clip-higher; verl dual clip).

Per token, with r = pi / mu anchored on the rollout engine's log-probs (no recomputed pi_old):

    l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))

so the gradient coefficient on A grad log pi is r, except 0 where (A > 0 and r > 1 + eps_high) or
(A < 0 and r < 1 - eps_low). eps_high > eps_low is DAPO's clip-higher (0.28 vs 0.2). With dual_clip = c (verl style,
c > 1, default there 3), tokens with A < 0 have their loss capped at -c A, so a huge ratio on a negative-advantage
token cannot produce an unbounded push (gradient 0 once r > c).
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import clip_metrics, masked_mean, ratio_metrics, tokens


class PPOClip(PolicyLoss):
    """PPO clip loss; `PPOClip()` is GRPO's, `PPOClip(eps_high=0.28)` is DAPO's clip-higher.

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()  # mu = 1 below, so r = pi
        >>> out = PPOClip()(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 2),
        ...                            advantages=torch.tensor([[1.0, -1.0]]), loss_mask=torch.ones(1, 2)))
        >>> [round(v, 4) for v in out.token_losses.tolist()[0]]  # both clipped: -1 * 1.2, 1 * 0.8
        [-1.2, 0.8]
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None) -> None:
        eps_high = eps_low if eps_high is None else eps_high
        if not 0 < eps_low < 1:
            raise ValueError(f"eps_low must be in (0, 1) (r is clipped below at 1 - eps_low); got {eps_low}. "
                             "PPO/GRPO use 0.2")
        if not eps_high > 0:
            raise ValueError(f"eps_high must be > 0 (r is clipped above at 1 + eps_high); got {eps_high}. "
                             "Leave it None for eps_high = eps_low, or 0.28 for DAPO's clip-higher")
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (A < 0 tokens have their loss capped at -dual_clip * A; c <= 1 "
                             f"would cap tokens inside the trust region); got {dual_clip}. verl uses 3; None disables")
        self.eps_low = float(eps_low)
        self.eps_high = float(eps_high)
        self.dual_clip = None if dual_clip is None else float(dual_clip)

    def __repr__(self) -> str:
        return f"PPOClip(eps_low={self.eps_low}, eps_high={self.eps_high}, dual_clip={self.dual_clip})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _logp, _logmu, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        unclipped = -adv * r  # [B, T]
        clipped = -adv * r.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)  # [B, T]
        loss = torch.maximum(unclipped, clipped)  # [B, T]
        if self.dual_clip is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -self.dual_clip * adv), loss)
        token_losses = loss * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():
            # tokens whose gradient the clip removes (the one-sided PPO conditions)
            low = (adv < 0) & (r < 1.0 - self.eps_low)  # [B, T]
            high = (adv > 0) & (r > 1.0 + self.eps_high)  # [B, T]
            metrics = {
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),
            }
            if self.dual_clip is not None:
                dual = (adv < 0) & (r > self.dual_clip)
                metrics["dual_clip_frac"] = masked_mean(dual.to(mask.dtype), mask)
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
