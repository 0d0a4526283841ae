"""VESPO: REINFORCE with a smooth, bounded weight of each sequence's importance ratio (arXiv 2602.10693; the authors'
recipe in verl and TRL's `loss_type="vespo"` define the details followed here).

Per sequence i, with the sequence importance weight W_i = pi(y_i) / mu(y_i) computed from the token log-ratios
(detached; each log r clamped to +-20, the sum clamped to +-20):

    log W_i = sum_t m_it (log pi_it - log mu_it)
    phi_i   = W_i^k exp(lambda (1 - W_i)) = exp(k log W_i - lambda (W_i - 1))      (detached; 0 if not finite)
    l_it    = -phi_i A_it log pi_it

(k, lambda) = (k_pos, lambda_pos) for a sequence whose advantage is >= 0 and (k_neg, lambda_neg) otherwise (the
advantage of its first loss token: astratk's trajectory advantages are constant over a sequence).

So the gradient on each token is the plain policy gradient -A grad log pi scaled by phi(W), a gamma-shaped function of
the *whole* sequence's ratio: phi(1) = 1 (on-policy samples are untouched), phi peaks at W = k / lambda, and phi -> 0
both as W -> 0 and as W -> infinity. A sequence that has drifted far from the sampler in either direction fades out
smoothly, instead of being clipped token by token (PPO) or kept with a truncated weight (TIS): the unbiased sequence
weight W is replaced by a bounded, low-variance surrogate of it. The different (k, lambda) for positive and negative
advantages make the two sides fade at different speeds (defaults: k_pos 2, lambda_pos 3: peak at W = 2/3, so
positive samples the policy already favours more than the sampler get less weight; k_neg 3, lambda_neg 2: peak at
1.5). The defaults are those of the authors' code and TRL.

W is anchored on mu, the engine that sampled (the references fold their rollout importance weight into W, so theirs
is pi / mu too). The value returned includes log pi, as REINFORCE's does: compare gradients, not values, across
implementations. Aggregation is the trainer's (`trainer.aggregation`).
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import LOG_RATIO_CLAMP, masked_max, masked_mean, masked_min, ratio_metrics, tokens


class VESPO(PolicyLoss):
    """-phi(W_i) A log pi with phi(W) = W^k exp(lambda (1 - W)), W_i the sequence's pi / mu.

    Example (one sequence, W = 1: phi = 1, the plain policy gradient; a second with W = e^20: phi = 0):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]).requires_grad_()
        >>> mu = torch.tensor([[-1.0, -1.0], [-11.0, -11.0]])
        >>> out = VESPO()(LossInputs(logprobs=lp, behavior_logprobs=mu, advantages=torch.ones(2, 2),
        ...                          loss_mask=torch.ones(2, 2)))
        >>> out.token_losses.sum().backward()
        >>> lp.grad.tolist()
        [[-1.0, -1.0], [-0.0, -0.0]]
    """

    def __init__(self, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
                 lambda_neg: float = 2.0) -> None:
        for name, v in (("k_pos", k_pos), ("lambda_pos", lambda_pos), ("k_neg", k_neg), ("lambda_neg", lambda_neg)):
            if not 0 < v < float("inf"):
                raise ValueError(f"VESPO's {name} must be a finite number > 0 (phi(W) = W^k exp(lambda (1 - W)) must "
                                 f"vanish at W = 0 and W = inf); got {v}. Defaults: k_pos 2, lambda_pos 3, k_neg 3, "
                                 "lambda_neg 2")
        self.k_pos, self.lambda_pos = float(k_pos), float(lambda_pos)
        self.k_neg, self.lambda_neg = float(k_neg), float(lambda_neg)

    def __repr__(self) -> str:
        return (f"VESPO(k_pos={self.k_pos}, lambda_pos={self.lambda_pos}, k_neg={self.k_neg}, "
                f"lambda_neg={self.lambda_neg})")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each; log r clamped per token
        with torch.no_grad():
            log_w = (log_r * mask).sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, 1]
            first = valid.to(mask.dtype).argmax(dim=-1, keepdim=True)  # [B, 1] the first loss token (0 if none)
            positive = adv.gather(-1, first) >= 0  # [B, 1]
            k = torch.where(positive, self.k_pos, self.k_neg).to(log_w.dtype)
            lam = torch.where(positive, self.lambda_pos, self.lambda_neg).to(log_w.dtype)
            phi = torch.exp(k * log_w - lam * torch.expm1(log_w))  # [B, 1]
            phi = torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))
        token_losses = -phi * adv * logp * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            rows = valid.any(-1)  # [B] non-empty sequences
            phi_row, w_row = phi.squeeze(-1), torch.exp(log_w.squeeze(-1))
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "seq_weight_mean": masked_mean(w_row, rows),
                "seq_weight_max": masked_max(w_row, rows),
                "phi_mean": masked_mean(phi_row, rows),
                "phi_min": masked_min(phi_row, rows),
                "phi_max": masked_max(phi_row, rows),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
