"""DRPO: divergence-regularised policy optimisation (arXiv 2606.09821, Eq. 8/9).

DPPO's hard Binary-TV trust region |pi - mu| <= delta (arXiv 2602.04879) becomes a smooth penalty: substituting the
token-adaptive SPO radius eps_t = delta / mu_t into SPO's |A|(r - 1)^2 / (2 eps) gives the per-token loss (Eq. 8)

    l_t = -A_t r_t + |A_t| mu_t (r_t - 1)^2 / (2 delta),      r_t = pi_t / mu_t,   mu_t (r_t - 1)^2 = (pi - mu)^2 / mu

with r anchored on the rollout engine's log-probs, differentiable and NOT truncated (log r clamped to
+-20 only), mu detached. Its gradient (Eq. 9) is -A_t r_t w_t grad log pi_t with

    w_t = 1 - sign(A_t (r_t - 1)) |pi_t - mu_t| / delta

so w = 1 on-policy, shrinks to 0 exactly at the DPPO boundary |pi - mu| = delta while moving away from mu, turns
negative beyond it (a push back toward mu, where DPPO gives 0), and exceeds 1 when moving back toward mu. Because
|pi - mu| <= 1, w stays in [1 - 1/delta, 1 + 1/delta] even for rare tokens (SPO's weight does not).

delta is the Binary-TV radius. The paper's 12.5 keeps |w - 1| <= 0.08, so the boundary is never reached (that is what
the authors' code runs); the boundary only binds for delta <~ 1 (the paper ablates 2.5). astratk's default is 1.0:
in its stability grid (docs/losses.md, 3 seeds x 4 off-policy regimes on the tiny model) delta = 1 collapsed in 1 of
12 runs and gained the most of any loss with samples 16 versions old, while 12.5 collapsed in 6 of 12 and delta <= 0.2
in every run at lag 16. Sweep other values explicitly and say so in the run config.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import masked_max, masked_mean, masked_min, ratio_metrics, tokens


def drpo_gradient_weight(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                         delta: float) -> torch.Tensor:
    """Eq. 9 weight w = 1 - sign(A (r - 1)) |pi - mu| / delta, elementwise, detached.

    sign(A (r - 1)) |pi - mu| = sign(A) (pi - mu) because sign(r - 1) = sign(pi - mu); A = 0 gives w = 1.
    """
    pi = torch.exp(logprobs.detach())  # [B, T]
    mu = torch.exp(behavior_logprobs.detach())  # [B, T]
    return 1.0 - torch.sign(advantages.detach()) * (pi - mu) / delta


class DRPO(PolicyLoss):
    """DRPO per-token loss (arXiv 2606.09821, Eq. 8). Pair with `seq-mean-token-sum-norm` and Dr.GRPO advantages.

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[0.6, 0.25]])).requires_grad_()
        >>> out = DRPO(delta=0.5)(LossInputs(logprobs=lp, behavior_logprobs=torch.log(torch.tensor([[0.5, 0.5]])),
        ...                                  advantages=torch.tensor([[1.0, -2.0]]), loss_mask=torch.ones(1, 2)))
        >>> [round(v, 4) for v in out.token_losses.tolist()[0]]
        [-1.18, 1.25]
        >>> round(out.metrics["w_min"].item(), 4)
        0.5
    """

    def __init__(self, delta: float = 1.0) -> None:
        if not delta > 0:  # also rejects NaN
            raise ValueError(f"delta must be > 0 (the Binary-TV radius of the trust region); got "
                             f"{delta}. The default is 1.0 (the paper uses 12.5); delta < 1 makes the boundary "
                             "|pi - mu| = delta bind")
        self.delta = float(delta)

    def __repr__(self) -> str:
        return f"DRPO(delta={self.delta})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _logp, logmu, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        mu = torch.exp(logmu)  # [B, T] detached
        coef = adv.abs().mul_(mu).mul_(0.5 / self.delta)  # [B, T] detached |A| mu / (2 delta); in place: one buffer
        d = r - 1.0  # [B, T]
        penalty = coef * d * d  # [B, T] |A| mu (r - 1)^2 / (2 delta)
        token_losses = torch.addcmul(penalty, adv, r, value=-1.0) * mask  # [B, T] Eq. 8: -A r + penalty
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():  # diagnostics, two [B, T] buffers: they are live together with the whole graph
            shift = mu.mul_(d)  # [B, T] pi - mu = mu (r - 1), in mu's buffer (mu is not needed after this)
            signed = torch.sign(adv).mul_(shift)  # [B, T] sign(A)(pi - mu), so w = 1 - signed / delta (Eq. 9)
            tv = shift.abs_()  # [B, T] Binary-TV |pi - mu|
            some = valid.any().to(mask.dtype)  # metrics of an empty batch are 0, w's included
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "penalty_mean": masked_mean(penalty, mask),
                "beyond_boundary_frac": masked_mean((tv > self.delta).to(mask.dtype), mask),
                "tv_mean": masked_mean(tv, mask),
                "tv_max": masked_max(tv, valid),
                "w_mean": some * (1.0 - masked_mean(signed, mask) / self.delta),
                "w_min": some * (1.0 - masked_max(signed, valid) / self.delta),
                "w_max": some * (1.0 - masked_min(signed, valid) / self.delta),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
