"""GPG: group policy gradient, plain REINFORCE on group advantages with no ratio and no clip (arXiv 2504.02546).

Per token:

    l_t = -alpha * A_t * log pi_t          gradient coefficient on A grad log pi: c_t = alpha

GPG drops the importance ratio, the clip and the KL term altogether and argues that, on-policy, the group baseline is
all a reasoning RL run needs. Its one correction is alpha = B / M, with B the number of sequences in the batch and M
those with a non-zero advantage: groups whose samples all scored alike contribute no gradient, and without the
rescaling they would dilute the others' share of the batch mean. With `rescale=False` alpha = 1. When the data layer
already drops zero-variance groups (astratk's default), alpha = 1 as well; sequences with an advantage of exactly 0 are
what alpha counts, so it is a batch statistic (all-reduced over data-parallel ranks).

No term involves mu: off-policy samples are trained as if on-policy, which is exactly what the stability comparison
wants to see (it is the "no correction at all" row). The scalar VALUE is -alpha A log pi, not a surrogate of the
return; compare gradients across implementations.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import ratio_metrics, tokens


class GPG(PolicyLoss):
    """Group policy gradient: -alpha A log pi per token.

    Example (two sequences, the second with A = 0: alpha = 2 / 1):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[0.5], [0.25]])).requires_grad_()
        >>> out = GPG()(LossInputs(logprobs=lp, behavior_logprobs=torch.log(torch.tensor([[0.4], [0.25]])),
        ...                        advantages=torch.tensor([[1.0], [0.0]]), loss_mask=torch.ones(2, 1)))
        >>> out.token_losses.sum().backward()
        >>> [abs(g) for g in lp.grad.flatten().tolist()], out.metrics["alpha"].item()  # gradient -alpha A
        ([2.0, 0.0], 2.0)
    """

    def __init__(self, rescale: bool = True) -> None:
        if rescale not in (True, False):
            raise ValueError(f"rescale must be true or false (alpha = sequences / sequences with a non-zero "
                             f"advantage); got {rescale!r}")
        self.rescale = bool(rescale)
        self.batch_statistics = self.rescale  # alpha counts sequences over the whole batch (all ranks)

    def __repr__(self) -> str:
        return f"GPG(rescale={self.rescale})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each
        alpha = torch.ones((), dtype=logp.dtype, device=logp.device)
        if self.rescale:
            with torch.no_grad():
                seqs = valid.any(dim=-1)  # [B] sequences with at least one token in the loss
                informative = (seqs & ((adv != 0) & valid).any(dim=-1)).to(logp.dtype).sum()  # M
                total = seqs.to(logp.dtype).sum()  # B (empty sequences contribute nothing either way)
                if inputs.reduce is not None:
                    informative, total = inputs.reduce(informative), inputs.reduce(total)
                alpha = torch.where(informative > 0, total / informative.clamp_min(1.0), alpha)
        token_losses = -alpha * adv * logp * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            metrics = {"alpha": alpha.detach(), **ratio_metrics(r, log_r, mask, valid)}
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
