"""GSPO: group sequence policy optimisation, one clipped ratio per sequence (arXiv 2507.18071).

With log r_it = log pi - log mu anchored on the rollout engine (clamped to +-20), n_i the sequence's
mask count and A_i its advantage (constant over the sequence; taken from its first masked token):

    log s_i = sum_t m_it log r_it / n_i          (the geometric mean of the token ratios)
    loss_i  = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))

averaged per sequence. The loss is returned as the per-token loss loss_i on each of the sequence's n_i masked tokens,
so `seq-mean-token-mean` aggregation, mean_i (sum_t loss_i / n_i) = mean_i loss_i, is exactly GSPO's objective; hence
`required_aggregation = "seq-mean-token-mean"`. In the sum-of-token-losses view the gradient coefficient on
A_i grad log pi_it is c_it = s_i (0 where the sequence is clipped: A > 0 and s > 1 + eps_high, or A < 0 and
s < 1 - eps_low); aggregation then divides by n_i, giving the paper's (1/n_i) s_i A_i grad log pi_it.

Token variant (GSPO-token, `GSPOToken` or `GSPO(variant="token")`): s_it = sg(s_i) pi_it / sg(pi_it), whose value is
s_i and whose gradient is s_i grad log pi_it, with per-token advantages A_it and the clip applied per token. With A
constant over a sequence it gives exactly the sequence variant's value and gradient (the paper's remark).
Defaults eps_low = 3e-4, eps_high = 4e-4 (the paper's; sequence ratios stay near 1, so the band is narrow).

Aggregation (`aggregation`, default "seq-mean-token-mean", the paper's objective). Other trainer modes are allowed and
change only how sequences are weighted against each other, since loss_i sits on each of its n_i tokens:

- "seq-mean-token-sum": mean_i n_i loss_i, each sequence weighted by its length. This is LUSPO's length-unbiased
  objective (arXiv 2602.05261): under seq-mean-token-mean a long sequence's tokens each get 1/n_i of the gradient,
  which biases GSPO towards short answers; LUSPO multiplies each sequence's loss by n_i. `LUSPO` (short name `luspo`)
  is this loss with that mode; TRL's notes on LUSPO give eps_low = 2e-3, eps_high = 2.5e-3 for its runs.
- "seq-mean-token-sum-norm": the same divided by the trainer's horizon H (a constant: the learning-rate scale of
  seq-mean-token-mean with LUSPO's weighting);
- "token-mean": sum_i n_i loss_i / sum_i n_i (length-weighted, normalised by the batch's tokens);
- "token-sum": sum_i n_i loss_i.

The mode is the loss's `required_aggregation`, so the trainer uses it whatever `trainer.aggregation` says.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import clip_metrics, masked_max, masked_mean, masked_min, ratio_metrics, tokens
from astratk.registry import check_choice
from astratk.spec.trainer import AGGREGATIONS

VARIANTS = ("sequence", "token")


class GSPO(PolicyLoss):
    """GSPO sequence-level clipped loss (arXiv 2507.18071); `variant="token"` is GSPO-token.

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[2.0, 0.5, 9.0]])).requires_grad_()  # mu = 1, r = (2, 0.5); 3rd is padding
        >>> out = GSPO()(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 3),
        ...                         advantages=-torch.ones(1, 3), loss_mask=torch.tensor([[1.0, 1.0, 0.0]])))
        >>> out.metrics["seq_ratio_mean"].item()  # sqrt(2 * 0.5): geometric mean, not the arithmetic 1.25
        1.0
        >>> out.token_losses.tolist()  # -A s on each masked token (A = -1)
        [[1.0, 1.0, 0.0]]
    """

    required_aggregation = "seq-mean-token-mean"

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, variant: str = "sequence",
                 aggregation: str = "seq-mean-token-mean") -> None:
        if not 0 < eps_low < 1:
            raise ValueError(f"eps_low must be in (0, 1) (s is clipped below at 1 - eps_low); got {eps_low}. "
                             "GSPO uses 3e-4")
        if not eps_high > 0:
            raise ValueError(f"eps_high must be > 0 (s is clipped above at 1 + eps_high); got {eps_high}. "
                             "GSPO uses 4e-4")
        check_choice("GSPO variant", variant, VARIANTS)
        self.required_aggregation = check_choice("aggregation", aggregation, AGGREGATIONS, where=type(self).__name__)
        self.eps_low, self.eps_high, self.variant = float(eps_low), float(eps_high), variant

    def __repr__(self) -> str:
        agg = "" if self.required_aggregation == "seq-mean-token-mean" else f", aggregation={self.required_aggregation!r}"
        return (f"{type(self).__name__}(eps_low={self.eps_low}, eps_high={self.eps_high}, "
                f"variant={self.variant!r}{agg})")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu
        n = mask.sum(dim=-1)  # [B]
        log_s = (log_r * mask).sum(dim=-1) / n.clamp_min(1.0)  # [B]; an empty sequence gets s = 1 (and no tokens)
        if self.variant == "sequence":
            first = valid.to(mask.dtype).argmax(dim=-1, keepdim=True)  # [B, 1] first masked token (0 if none)
            a = adv.gather(-1, first)  # [B, 1] A_i
            s = torch.exp(log_s).unsqueeze(-1)  # [B, 1]
        else:
            a = adv  # [B, T] per-token advantages
            s = torch.exp(log_s.detach().unsqueeze(-1) + logp - logp.detach())  # [B, T] value s_i, grad s_i dlog pi
        loss = torch.maximum(-a * s, -a * s.clamp(1.0 - self.eps_low, 1.0 + self.eps_high))  # [B, 1] or [B, T]
        token_losses = loss * mask  # [B, T] loss_i spread over the sequence's masked tokens
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():
            low = ((a < 0) & (s < 1.0 - self.eps_low)).expand_as(mask)  # [B, T] tokens whose gradient the clip removes
            high = ((a > 0) & (s > 1.0 + self.eps_high)).expand_as(mask)  # [B, T]
            seq_ratio, nonempty = torch.exp(log_s), n > 0  # [B]
            metrics = {
                "seq_ratio_mean": masked_mean(seq_ratio, nonempty),
                "seq_ratio_max": masked_max(seq_ratio, nonempty),
                "seq_ratio_min": masked_min(seq_ratio, nonempty),
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)


class GSPOToken(GSPO):
    """GSPO-token: `GSPO(variant="token")` under its own name, for configs and the registry (`gspo_token`).

    Example:
        >>> GSPOToken()
        GSPOToken(eps_low=0.0003, eps_high=0.0004, variant='token')
    """

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4,
                 aggregation: str = "seq-mean-token-mean") -> None:
        super().__init__(eps_low=eps_low, eps_high=eps_high, variant="token", aggregation=aggregation)


class LUSPO(GSPO):
    """LUSPO (arXiv 2602.05261): GSPO with each sequence's loss weighted by its length, i.e. `GSPO(aggregation=
    "seq-mean-token-sum")` under its own name (`luspo`). Same clip defaults as GSPO.

    Example:
        >>> LUSPO().required_aggregation
        'seq-mean-token-sum'
    """

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, variant: str = "sequence") -> None:
        super().__init__(eps_low=eps_low, eps_high=eps_high, variant=variant, aggregation="seq-mean-token-sum")

    def __repr__(self) -> str:
        return f"LUSPO(eps_low={self.eps_low}, eps_high={self.eps_high}, variant={self.variant!r})"
