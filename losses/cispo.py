"""CISPO / PG-TIS: truncated importance weight as a stop-gradient coefficient.

Per token, with r = pi / mu anchored on the rollout engine's log-probs:

    l_t = -A_t sg(min(r_t, C)) log pi_t      gradient coefficient on A grad log pi: c_t = min(r_t, C)

Unlike PPO's clip, no token loses its gradient: a token with r > C keeps weight C (MiniMax-M1, arXiv 2506.13585, which
clips the IS weight rather than the update). DPPO's authors implement their mask in this same form.
The scalar VALUE of l_t is not the surrogate's value: compare gradients, not losses, across implementations.
Default C = 5 (3-5 is the usual range; DPPO's scaling runs use 5).
Lower clip: MiniMax writes the weight as clip(r, 1 - eps_low, 1 + eps_high) and leaves eps_low large enough that it
never binds. `ratio_floor` = 1 - eps_low sets it: c_t = min(max(r_t, floor), C). Default 0 (no floor, the paper's
setting); a floor such as 0.5 keeps tokens whose probability collapsed since sampling (r -> 0) from losing their
gradient entirely, at the price of a larger bias on them. There is no trust region: DPPO reports that
truncated IS alone does not stabilise training (arXiv 2602.04879); it is a neighbour to compare against.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import masked_mean, ratio_metrics, tokens


class CISPO(PolicyLoss):
    """Truncated-IS policy gradient: -A sg(min(r, C)) log pi per token.

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[0.6, 0.25]])).requires_grad_()
        >>> out = CISPO(ratio_cap=2.0)(LossInputs(logprobs=lp, behavior_logprobs=torch.log(torch.tensor([[0.1, 0.5]])),
        ...                                       advantages=torch.tensor([[1.0, -1.0]]), loss_mask=torch.ones(1, 2)))
        >>> out.token_losses.sum().backward()
        >>> [round(g, 4) for g in lp.grad.tolist()[0]]  # -A min(r, C): r = 6 capped at 2; r = 0.5 kept
        [-2.0, 0.5]
    """

    def __init__(self, ratio_cap: float = 5.0, ratio_floor: float = 0.0) -> None:
        if not ratio_cap >= 1:  # also rejects NaN
            raise ValueError(f"ratio_cap must be >= 1 (tokens with r > C keep gradient weight C; C < 1 would "
                             f"down-weight on-policy tokens); got {ratio_cap}. Use 3-5, or 10000 to "
                             "disable truncation")
        if not 0 <= ratio_floor <= 1:  # also rejects NaN
            raise ValueError(f"ratio_floor must be in [0, 1] (tokens with r below it keep gradient weight "
                             f"ratio_floor; it is 1 - eps_low of MiniMax's clip); got {ratio_floor}. 0 disables it")
        self.ratio_cap, self.ratio_floor = float(ratio_cap), float(ratio_floor)

    def __repr__(self) -> str:
        floor = f", ratio_floor={self.ratio_floor}" if self.ratio_floor else ""
        return f"CISPO(ratio_cap={self.ratio_cap}{floor})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        coef = r.detach().clamp(min=self.ratio_floor, max=self.ratio_cap)  # [B, T] sg(min(max(r, floor), C))
        token_losses = -adv * coef * logp * mask  # [B, T] value is not the surrogate's; the gradient is
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "truncated_frac": masked_mean((r > self.ratio_cap).to(mask.dtype), mask),
            }
            if self.ratio_floor:
                metrics["floored_frac"] = masked_mean((r < self.ratio_floor).to(mask.dtype), mask)
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
