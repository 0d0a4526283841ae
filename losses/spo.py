"""SPO: simple policy optimisation, a quadratic ratio penalty instead of a clip (arXiv 2401.16025).

Per token, with r = pi / mu anchored on the rollout engine's log-probs, differentiable and not
truncated (log r clamped to +-20 only):

    l_t = -A_t r_t + |A_t| (r_t - 1)^2 / (2 eps)

Gradient coefficient on A grad log pi (d l / d log pi = r dl/dr = -A c_t):

    c_t = r_t w_t,   w_t = 1 - sign(A_t (r_t - 1)) |r_t - 1| / eps

so w = 0 at |r - 1| = eps while moving away from mu and negative beyond. The radius is in ratio space, so a rare token
(small mu) can move its probability far before the penalty binds, and c is unbounded as mu -> 0; DRPO
(`astratk.losses.drpo`) replaces eps by the token-adaptive delta / mu. Default eps = 12.5, the value
the DRPO paper used for its SPO comparison.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import masked_max, masked_mean, masked_min, ratio_metrics, tokens


class SPO(PolicyLoss):
    """SPO per-token loss -A r + |A| (r - 1)^2 / (2 eps) (arXiv 2401.16025).

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()  # mu = 1 below, so r = pi
        >>> out = SPO(eps=0.5)(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 2),
        ...                               advantages=torch.tensor([[1.0, -2.0]]), loss_mask=torch.ones(1, 2)))
        >>> out.token_losses.tolist()  # -1.5 + 0.25/1, 1 + 2 * 0.25/1
        [[-1.25, 1.5]]
        >>> out.metrics["w_min"].item()  # both move away from mu by |r - 1| = eps: w = 1 - 0.5 / 0.5
        0.0
    """

    def __init__(self, eps: float = 12.5) -> None:
        if not eps > 0:  # also rejects NaN
            raise ValueError(f"eps must be > 0 (the ratio radius |r - 1| at which the gradient weight reaches 0); got "
                             f"{eps}. The DRPO paper's SPO comparison uses 12.5")
        self.eps = float(eps)

    def __repr__(self) -> str:
        return f"SPO(eps={self.eps})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        penalty = adv.abs() * (r - 1.0) ** 2 / (2.0 * self.eps)  # [B, T]
        token_losses = (-adv * r + penalty) * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            w = 1.0 - torch.sign(adv) * (r - 1.0) / self.eps  # [B, T] sign(A (r-1)) |r-1| = sign(A) (r-1)
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "penalty_mean": masked_mean(penalty, mask),
                "beyond_radius_frac": masked_mean((w < 0).to(mask.dtype), mask),
                "w_mean": masked_mean(w, mask),
                "w_min": masked_min(w, valid),
                "w_max": masked_max(w, valid),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
