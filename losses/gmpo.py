"""GMPO: geometric-mean policy optimisation, a sequence objective from the geometric mean of clipped token ratios
(arXiv 2507.20673).

GRPO averages token ratios arithmetically, so one outlier token with a huge ratio dominates the sequence's update.
GMPO takes their geometric mean, clipping each token's log-ratio first. With log r_it = log pi - log mu anchored on
the rollout engine (clamped to +-20), n_i the sequence's mask count, A_i its advantage (the mean of its tokens'
advantages, which is A_i itself when it is constant over the sequence) and sgn = sign(A_i):

    g_it    = sgn * min(sgn * log r_it, sgn * clip(log r_it, -eps_low, eps_high))    (PPO's pessimism, in log space)
    s_i     = exp(sum_t m_it g_it / n_i)
    loss_i  = -A_i s_i

averaged per sequence: the per-token loss is loss_i on each of the sequence's masked tokens and aggregation is
`seq-mean-token-mean` (required). Gradient: -A_i s_i / n_i on grad log pi_it for each token whose log-ratio is inside
the clip on its side, 0 for a token clipped (A > 0 and log r > eps_high, or A < 0 and log r < -eps_low). Defaults
eps_low = eps_high = 0.4 (the paper's clip range (e^-0.4, e^0.4), wider than GRPO's because the geometric mean is
already tame).
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import clip_metrics, masked_max, masked_mean, masked_min, ratio_metrics, tokens


class GMPO(PolicyLoss):
    """GMPO sequence loss (arXiv 2507.20673).

    Example (A = 1; log r = (0.2, 1.0): the second is clipped to 0.4, so s = exp((0.2 + 0.4) / 2) = e^0.3):
        >>> import math, torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[0.2, 1.0]]).requires_grad_()  # mu = 1 below, so log r = log pi
        >>> out = GMPO()(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2),
        ...                         loss_mask=torch.ones(1, 2)))
        >>> round(out.metrics["seq_ratio_mean"].item(), 4) == round(math.exp(0.3), 4)
        True
        >>> out.token_losses.sum().backward()  # seq-mean-token-mean divides the sum by n = 2 again
        >>> [round(g, 4) for g in lp.grad.tolist()[0]] == [round(-math.exp(0.3), 4), 0.0]
        True
    """

    required_aggregation = "seq-mean-token-mean"

    def __init__(self, eps_low: float = 0.4, eps_high: float | None = None) -> None:
        eps_high = eps_low if eps_high is None else eps_high
        for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be > 0 (a token's log-ratio is clipped to [-eps_low, eps_high]); got "
                                 f"{value}. GMPO uses 0.4")
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)

    def __repr__(self) -> str:
        return f"GMPO(eps_low={self.eps_low}, eps_high={self.eps_high})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _, _, adv, log_r, r = tokens(inputs)  # [B, T] each; log r anchored on mu, with gradient
        n = mask.sum(dim=-1, keepdim=True)  # [B, 1]
        a = (adv * mask).sum(dim=-1, keepdim=True) / n.clamp_min(1.0)  # [B, 1] the sequence's advantage
        sgn = torch.where(a < 0, -1.0, 1.0).to(log_r.dtype)  # [B, 1]; A = 0 contributes 0 either way
        clipped = log_r.clamp(-self.eps_low, self.eps_high)  # [B, T]
        g = sgn * torch.minimum(sgn * log_r, sgn * clipped)  # [B, T]
        s = torch.exp((g * mask).sum(dim=-1, keepdim=True) / n.clamp_min(1.0))  # [B, 1]
        token_losses = -a * s * mask  # [B, T] loss_i on each masked token
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():
            low = ((a < 0) & (log_r < -self.eps_low)) & valid  # [B, T] tokens whose gradient the clip removes
            high = ((a > 0) & (log_r > self.eps_high)) & valid
            seq, nonempty = s.squeeze(-1), n.squeeze(-1) > 0  # [B]
            metrics = {
                "seq_ratio_mean": masked_mean(seq, nonempty),
                "seq_ratio_max": masked_max(seq, nonempty),
                "seq_ratio_min": masked_min(seq, nonempty),
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
