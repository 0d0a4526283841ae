"""DRO: the policy gradient with a quadratic penalty on the log-ratio to the old policy (verl's `dro` policy loss,
named after Direct Reward Optimization (Richemond et al., 2024); the same squared log-ratio regulariser is in Kimi
k1.5's policy mirror descent, arXiv 2501.12599 §2.3.2).

Per token, with log pi differentiable and an anchor policy pi_a detached:

    l_t = -A_t log pi_t + (beta / 2) (log pi_t - log pi_a_t)^2

Its gradient with respect to log pi_t is -A_t + beta (log pi_t - log pi_a_t): the REINFORCE term, plus a restoring
force that grows linearly with how far the token's log-prob has moved from the anchor, in either direction. Unlike a
clip it never zeroes a token's gradient; unlike DRPO's or SPO's penalty it does not scale with |A|, so it also pulls
back tokens of zero-advantage groups. beta sets the stiffness: at |log pi - log pi_a| = |A| / beta the two terms
cancel for a token moving in its advantage's direction.

The anchor (`anchor`):

- "proximal" (the default, as in verl, whose old log-probs are the trainer's recomputed ones): pi_old, the trainer's
  no-grad forward at the start of the step (`LossInputs.proximal_logprobs`, filled because `needs_proximal` is True).
  With one optimiser update per batch the penalty's gradient is 0 at that update (pi = pi_old in value); it acts
  across `trainer.updates_per_batch` > 1 updates or micro-batch updates, as a trust region.
- "behavior": mu, the rollout engine's log-probs, so the penalty also holds stale or mismatched samples near the
  policy that sampled them (the off-policy use, as DRPO's and SPO's penalties).

Kimi's form squares the *sequence* log-ratio (the sum over tokens); this loss squares each token's, as verl's does.
No default for beta: verl has none either (its tests use 0.05); pick it with the anchor's scale in mind.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import LOG_RATIO_CLAMP, masked_max, masked_mean, ratio_metrics, sanitize, tokens
from astratk.registry import check_choice

ANCHORS: tuple[str, ...] = ("proximal", "behavior")


class DRO(PolicyLoss):
    """-A log pi + (beta / 2) (log pi - log pi_anchor)^2 per token.

    Example (beta 0.5, anchored on mu: log pi - log mu = 0.2, A = 1 -> gradient -1 + 0.5 * 0.2 = -0.9):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[-1.0]]).requires_grad_()
        >>> out = DRO(beta=0.5, anchor="behavior")(LossInputs(logprobs=lp, behavior_logprobs=torch.tensor([[-1.2]]),
        ...                                                   advantages=torch.ones(1, 1), loss_mask=torch.ones(1, 1)))
        >>> round(out.token_losses.item(), 4)  # 1 + 0.25 * 0.04
        1.01
        >>> out.token_losses.sum().backward()
        >>> round(lp.grad.item(), 4)
        -0.9
    """

    def __init__(self, beta: float, anchor: str = "proximal") -> None:
        if not beta > 0 or beta == float("inf"):  # also rejects NaN
            raise ValueError(f"DRO's beta must be a finite number > 0 (the weight of (beta / 2) (log pi - log "
                             f"pi_anchor)^2); got {beta}. There is no standard value: verl's tests use 0.05")
        self.beta = float(beta)
        self.anchor = check_choice("anchor", anchor, ANCHORS, where="DRO")
        self.needs_proximal = self.anchor == "proximal"

    def __repr__(self) -> str:
        return f"DRO(beta={self.beta}, anchor={self.anchor!r})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, logmu, adv, log_r, r = tokens(inputs)  # [B, T] each; r = pi / mu for the diagnostics
        if self.anchor == "proximal":
            if inputs.proximal_logprobs is None:
                raise ValueError("DRO(anchor='proximal') needs LossInputs.proximal_logprobs [B, T] (the trainer fills "
                                 "them because needs_proximal is True; when calling the loss directly, pass the "
                                 "no-grad log-probs of the old policy, or use anchor='behavior')")
            log_anchor = sanitize(inputs.proximal_logprobs.detach(), valid)
        else:
            log_anchor = logmu
        shift = (logp - log_anchor).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T] log pi - log pi_a, grad flows
        penalty = 0.5 * self.beta * shift**2  # [B, T]
        token_losses = (-adv * logp + penalty) * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "penalty_mean": masked_mean(penalty, mask),
                "anchor_shift_abs_mean": masked_mean(shift.abs(), mask),
                "anchor_shift_abs_max": masked_max(shift.abs(), valid),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
