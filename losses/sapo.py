"""SAPO: soft adaptive policy optimisation, a sigmoid gate instead of a hard clip (arXiv 2511.20347).

Per token, with r = pi / mu anchored on the rollout engine's log-probs (log r clamped to +-20):

    l_t = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A_t,      tau_t = tau_pos if A_t > 0 else tau_neg

Gradient coefficient on A grad log pi (d l / d log pi = -A c_t):

    c_t = r_t g_t,   g_t = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1)))

The gate g is 1 on-policy (r = 1), decays smoothly as r leaves 1 in either direction (no hard band, so a few
off-policy tokens do not silence their neighbours), and the 4 / tau factor keeps the on-policy gradient equal to
plain PG for any tau. tau_neg > tau_pos makes the gate close faster for negative advantages. Note the loss VALUE at
r = 1 is -2A / tau, not -A. Defaults tau_pos = 1.0, tau_neg = 1.05.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import masked_mean, masked_min, ratio_metrics, tokens


class SAPO(PolicyLoss):
    """SAPO per-token loss -(4 / tau) sigmoid(tau (r - 1)) A (arXiv 2511.20347).

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.zeros(1, 2, requires_grad=True)  # on-policy: r = 1, gate 1
        >>> out = SAPO()(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 2),
        ...                         advantages=torch.tensor([[1.0, -1.0]]), loss_mask=torch.ones(1, 2)))
        >>> [round(v, 4) for v in out.token_losses.tolist()[0]]  # -2A / tau: -2 / 1, 2 / 1.05
        [-2.0, 1.9048]
        >>> out.token_losses.sum().backward()
        >>> lp.grad.tolist()  # -A r g with g = 1: plain PG on-policy
        [[-1.0, 1.0]]
    """

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05) -> None:
        for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if not tau > 0:  # also rejects NaN
                raise ValueError(f"{name} must be > 0 (the gate's temperature: larger closes faster as r leaves 1); "
                                 f"got {tau}. The paper uses tau_pos = 1.0, tau_neg = 1.05")
        self.tau_pos, self.tau_neg = float(tau_pos), float(tau_neg)

    def __repr__(self) -> str:
        return f"SAPO(tau_pos={self.tau_pos}, tau_neg={self.tau_neg})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        # in r's dtype from the start: torch.where on two Python floats would build float32 (1.05 -> 1.0499999523)
        tau = r.new_full(r.shape, self.tau_neg).masked_fill_(adv > 0, self.tau_pos)  # [B, T]
        sig = torch.sigmoid(tau * (r - 1.0))  # [B, T]
        token_losses = -(4.0 / tau) * sig * adv * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            gate = 4.0 * sig * (1.0 - sig)  # [B, T] in (0, 1], 1 at r = 1
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "gate_mean": masked_mean(gate, mask),
                "gate_min": masked_min(gate, valid),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
