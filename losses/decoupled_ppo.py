"""Decoupled PPO: the trust region on a recomputed proximal policy, the importance weight on the behaviour policy
(AReaL, arXiv 2505.24298, §4 "decoupled PPO objective").

Asynchronous training samples with a behaviour policy mu that may be several versions old. Naive PPO centres its clip
on mu, so the further mu lags, the tighter the clip binds around an outdated policy. The decoupled objective separates
the two jobs of the ratio: the *trust region* is centred on the proximal policy pi_prox (a recent policy: here the
trainer's own no-grad forward at the start of the step), and the *off-policy correction* is the importance weight
pi_prox / mu, which carries no gradient. Per token (logs clamped to +-20 before exp):

    u_t = pi_t / pi_prox_t                       the proximal ratio, clipped as in PPO
    w_t = sg(pi_prox_t / mu_t)                   the behaviour importance weight
    l_t = w_t * max(-A_t u_t, -A_t clip(u_t, 1 - eps_low, 1 + eps_high))

so the gradient coefficient on A grad log pi is w_t u_t (= pi / mu, the true importance weight), except 0 where
(A > 0 and u > 1 + eps_high) or (A < 0 and u < 1 - eps_low). With mu = pi_prox (a synchronous run) it is exactly
`PPOClip` anchored on mu. AReaL reports it holding AIME24 41-42 up to staleness 8 where naive PPO falls from 42.0 to
23.3 at staleness 4.

`behavior_weight_cap` (AReaL's `behav_imp_weight_cap`, off by default): tokens with w_t above the cap lose their
gradient (their loss is 0) but stay in the mask, so aggregation denominators do not change; they are counted in
`weight_capped_frac`. The proximal forward costs one extra no-grad forward per step (the trainer fills
`LossInputs.proximal_logprobs` because `needs_proximal` is True). pi_prox is the trainer's policy at the start of the
step, not at any rollout version: with one optimiser step per batch, u = 1 in value at that step and the clip binds
only across micro-batch updates or where the proximal forward and the gradient forward differ.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import (
    LOG_RATIO_CLAMP,
    clip_metrics,
    masked_max,
    masked_mean,
    ratio_metrics,
    sanitize,
    tokens,
)


class DecoupledPPO(PolicyLoss):
    """AReaL's decoupled PPO: clip pi / pi_prox, weight by sg(pi_prox / mu).

    Example (mu 0.25, pi_prox 0.5, pi 0.7, A = 1: u = 1.4 > 1.2 is clipped, so no gradient; w = 2 scales the value):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[0.7, 0.55]])).requires_grad_()
        >>> out = DecoupledPPO()(LossInputs(logprobs=lp, behavior_logprobs=torch.log(torch.tensor([[0.25, 0.5]])),
        ...                                 advantages=torch.tensor([[1.0, 1.0]]), loss_mask=torch.ones(1, 2),
        ...                                 proximal_logprobs=torch.log(torch.tensor([[0.5, 0.5]]))))
        >>> [round(v, 4) for v in out.token_losses.tolist()[0]]  # -w * 1.2 = -2.4; -1 * 1.1
        [-2.4, -1.1]
        >>> out.token_losses.sum().backward()
        >>> [round(g, 4) for g in lp.grad.tolist()[0]]  # clipped: 0; inside: -A w u = -pi / mu = -1.1
        [0.0, -1.1]
    """

    needs_proximal = True

    def __init__(self, eps_low: float = 0.2, eps_high: float | None = None,
                 behavior_weight_cap: float | None = None) -> None:
        eps_high = eps_low if eps_high is None else eps_high
        if not 0 < eps_low < 1:
            raise ValueError(f"eps_low must be in (0, 1) (pi / pi_prox is clipped below at 1 - eps_low); got "
                             f"{eps_low}. AReaL uses 0.2")
        if not eps_high > 0:
            raise ValueError(f"eps_high must be > 0 (pi / pi_prox is clipped above at 1 + eps_high); got {eps_high}. "
                             "Leave it None for eps_high = eps_low")
        if behavior_weight_cap is not None and not behavior_weight_cap > 1:
            raise ValueError(f"behavior_weight_cap must be > 1 (tokens with pi_prox / mu above it lose their "
                             f"gradient; <= 1 would drop on-policy tokens); got {behavior_weight_cap}. None disables it")
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.behavior_weight_cap = None if behavior_weight_cap is None else float(behavior_weight_cap)

    def __repr__(self) -> str:
        return (f"DecoupledPPO(eps_low={self.eps_low}, eps_high={self.eps_high}, "
                f"behavior_weight_cap={self.behavior_weight_cap})")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        if inputs.proximal_logprobs is None:
            raise ValueError("DecoupledPPO needs LossInputs.proximal_logprobs [B, T] (the trainer fills them because "
                             "needs_proximal is True; when calling the loss directly, pass the no-grad log-probs of "
                             "the policy the trust region is centred on)")
        valid, mask, logp, logmu, adv, log_r, r = tokens(inputs)  # [B, T] each; r = pi / mu
        log_prox = sanitize(inputs.proximal_logprobs.detach(), valid)  # [B, T]
        log_u = (logp - log_prox).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T] proximal ratio, grad flows
        u = torch.exp(log_u)
        w = torch.exp((log_prox - logmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T] detached weight
        if self.behavior_weight_cap is not None:
            capped = valid & (w > self.behavior_weight_cap)  # [B, T]
            w = w.masked_fill(capped, 0.0)
        loss = torch.maximum(-adv * u, -adv * u.clamp(1.0 - self.eps_low, 1.0 + self.eps_high))  # [B, T]
        token_losses = w * loss * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():
            low = (adv < 0) & (u < 1.0 - self.eps_low)  # [B, T] tokens whose gradient the clip removes
            high = (adv > 0) & (u > 1.0 + self.eps_high)
            w_all = torch.exp((log_prox - logmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # before the cap
            metrics = {
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),  # pi / mu: the whole off-policy gap
                "behavior_weight_mean": masked_mean(w_all, mask),
                "behavior_weight_max": masked_max(w_all, valid),
                "proximal_ratio_max": masked_max(u, valid),
            }
            if self.behavior_weight_cap is not None:
                metrics["weight_capped_frac"] = masked_mean(capped.to(mask.dtype), mask)
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
