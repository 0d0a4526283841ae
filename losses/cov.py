"""Clip-Cov and KL-Cov: entropy control through the tokens whose log-prob and advantage covary most
(Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

The paper shows that a policy's entropy falls, step by step, by roughly the covariance between a token's log-prob and
its advantage: confident tokens with high advantage are what collapse entropy. Both losses act on the few tokens with
the largest centred product, computed per token over the step's batch (detached):

    cov_t = (A_t - mean A) * (log pi_t - mean log pi)          means over the batch's loss tokens

- **Clip-Cov**: PPO's clipped surrogate anchored on mu (`PPOClip`), and in addition a random `clip_ratio` share of the
  loss tokens whose cov_t lies in (cov_low, cov_high) lose their gradient (their loss is 0; they stay in the
  aggregation denominator). Defaults r = 2e-4, (1, 5): the paper's.
- **KL-Cov**: the importance-sampled policy gradient -A r on every token, plus kl_coef * |log pi - log mu| on the
  top `kl_ratio` share of loss tokens by cov_t. Defaults k = 2e-3 (the paper's value for 7B models; 2e-4 for 32B),
  kl_coef = 1.

Selection rules. The paper states the shares; the authors' released code (their recipe in verl, the RL library the
paper's experiments ran on: `compute_policy_loss_clip_cov` and `compute_policy_loss_kl_cov`) fixes the details, and
these losses follow it so that a run here and a run there pick the same tokens:

- both pick max(1, floor(share * loss tokens)) tokens whenever the batch has any loss token: a small batch still
  gets one (KL-Cov's floor alone would penalise no token at all below 1 / kl_ratio tokens);
- Clip-Cov draws its picks only among candidates that PPO's ratio clip has not already stopped (A > 0 and
  r > 1 + eps_high, or A < 0 and r < 1 - eps_low): such a token's gradient is already 0, and a pick spent on it would
  remove nothing. With fewer candidates than picks, every candidate is picked;
- KL-Cov's top tokens are the loss tokens of largest cov_t, whatever its sign.

Both are batch statistics (`batch_statistics = True`): under micro-batches the trainer calls them once on the whole
step's batch, so the selection is the step's, not a micro-batch's. Under data parallelism the means are all-reduced
and each rank selects among its own tokens (its own count sets its number of picks). Clip-Cov's random pick uses the
loss's own generator (`seed`), so a run is reproducible. Both losses' scalar values include the penalty; the gradient
is what to compare across implementations.
"""

from __future__ import annotations

import math

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import clip_metrics, masked_mean, ratio_metrics, tokens


def centred_covariance(adv: torch.Tensor, logp: torch.Tensor, valid: torch.Tensor,
                       reduce=None) -> torch.Tensor:
    """cov_t = (A_t - mean A)(log pi_t - mean log pi) over the valid tokens, [B, T] -> [B, T], detached; 0 off them.
    `reduce` sums over data-parallel ranks (the means are then the global batch's)."""
    m = valid.to(logp.dtype)
    adv, logp = adv.detach() * m, logp.detach() * m
    sums = torch.stack([adv.sum(), logp.sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    count = sums[2].clamp_min(1.0)
    return ((adv - sums[0] / count) * (logp - sums[1] / count)) * m


class ClipCov(PolicyLoss):
    """PPO clip plus Clip-Cov: a random share of the high-covariance tokens lose their gradient.

    Example (four tokens; mean A = 0.375, mean log pi = -1.9, so cov = (2.925, 0.9625, -0.0125, 0.525): only token 0
    lies in (1, 5), and it is picked: its loss and gradient are 0):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[-0.1, -3.0, -2.0, -2.5]]).requires_grad_()
        >>> out = ClipCov()(LossInputs(logprobs=lp, behavior_logprobs=lp.detach(),
        ...                            advantages=torch.tensor([[2.0, -0.5, 0.5, -0.5]]), loss_mask=torch.ones(1, 4)))
        >>> out.token_losses.tolist()[0][0], out.metrics["cov_clip_frac"].item()
        (0.0, 0.25)
    """

    batch_statistics = True

    def __init__(self, eps_low: float = 0.2, eps_high: float | None = None, clip_ratio: float = 2e-4,
                 cov_low: float = 1.0, cov_high: float = 5.0, seed: int = 0) -> None:
        eps_high = eps_low if eps_high is None else eps_high
        if not 0 < eps_low < 1:
            raise ValueError(f"eps_low must be in (0, 1) (r is clipped below at 1 - eps_low); got {eps_low}")
        if not eps_high > 0:
            raise ValueError(f"eps_high must be > 0 (r is clipped above at 1 + eps_high); got {eps_high}")
        if not 0 < clip_ratio <= 1:
            raise ValueError(f"clip_ratio must be in (0, 1] (the share of loss tokens whose gradient Clip-Cov "
                             f"removes); got {clip_ratio}. The paper uses 2e-4")
        if not cov_low < cov_high:
            raise ValueError(f"cov_low must be < cov_high (tokens with covariance in (cov_low, cov_high) are "
                             f"candidates); got {cov_low}, {cov_high}. The paper uses (1, 5)")
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.clip_ratio, self.cov_low, self.cov_high, self.seed = float(clip_ratio), float(cov_low), float(
            cov_high), int(seed)
        self._generator = torch.Generator().manual_seed(self.seed)

    def __repr__(self) -> str:
        return (f"ClipCov(eps_low={self.eps_low}, eps_high={self.eps_high}, clip_ratio={self.clip_ratio}, "
                f"cov_low={self.cov_low}, cov_high={self.cov_high}, seed={self.seed})")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_generator"] = self._generator.get_state()
        return state

    def __setstate__(self, state: dict) -> None:
        generator = torch.Generator()
        generator.set_state(state.pop("_generator"))
        self.__dict__.update(state, _generator=generator)

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu
        with torch.no_grad():
            low = (adv < 0) & (r < 1.0 - self.eps_low)  # [B, T] tokens whose gradient PPO's clip removes
            high = (adv > 0) & (r > 1.0 + self.eps_high)
            cov = centred_covariance(adv, logp, valid, inputs.reduce)  # [B, T]
            candidates = valid & (cov > self.cov_low) & (cov < self.cov_high)  # [B, T]
            flat = (candidates & ~(low | high)).reshape(-1).nonzero().squeeze(-1).cpu()  # positions to draw from
            n_pick = min(max(int(self.clip_ratio * int(valid.sum())), 1), flat.numel())
            picked = torch.zeros(valid.numel(), dtype=torch.bool)
            if n_pick:
                picked[flat[torch.randperm(flat.numel(), generator=self._generator)[:n_pick]]] = True
            picked = picked.reshape(valid.shape).to(valid.device)  # [B, T]
        loss = torch.maximum(-adv * r, -adv * r.clamp(1.0 - self.eps_low, 1.0 + self.eps_high))  # [B, T]
        token_losses = loss.masked_fill(picked, 0.0) * mask
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            metrics = {
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),
                "cov_mean": masked_mean(cov, mask),
                "cov_candidates_frac": masked_mean(candidates.to(mask.dtype), mask),
                "cov_clip_frac": masked_mean(picked.to(mask.dtype), mask),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)


class KLCov(PolicyLoss):
    """Importance-sampled PG plus KL-Cov: a |log pi - log mu| penalty on the top covariance tokens.

    Example (kl_ratio 0.5 of four tokens: the two with the largest covariance get the penalty |log r|):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[-0.1, -3.0, -2.0, -2.5]]).requires_grad_()
        >>> out = KLCov(kl_ratio=0.5)(LossInputs(logprobs=lp, behavior_logprobs=lp.detach() - 0.1,
        ...                                     advantages=torch.tensor([[2.0, -1.0, 0.5, -1.5]]),
        ...                                     loss_mask=torch.ones(1, 4)))
        >>> out.metrics["kl_cov_frac"].item()
        0.5
    """

    batch_statistics = True

    def __init__(self, kl_ratio: float = 2e-3, kl_coef: float = 1.0) -> None:
        if not 0 < kl_ratio <= 1:
            raise ValueError(f"kl_ratio must be in (0, 1] (the share of loss tokens, by covariance, that get the KL "
                             f"penalty); got {kl_ratio}. The paper uses 2e-3 (7B) or 2e-4 (32B)")
        if not 0 <= kl_coef < float("inf"):
            raise ValueError(f"kl_coef must be >= 0 (the weight of |log pi - log mu| on the selected tokens); got "
                             f"{kl_coef}. The paper uses 1")
        self.kl_ratio, self.kl_coef = float(kl_ratio), float(kl_coef)

    def __repr__(self) -> str:
        return f"KLCov(kl_ratio={self.kl_ratio}, kl_coef={self.kl_coef})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu
        with torch.no_grad():
            cov = centred_covariance(adv, logp, valid, inputs.reduce)  # [B, T]
            n = int(valid.sum())
            k = max(1, math.floor(self.kl_ratio * n)) if n else 0
            chosen = torch.zeros_like(valid)
            if k > 0:
                top = cov.masked_fill(~valid, float("-inf")).reshape(-1).topk(k).indices
                chosen.view(-1)[top] = True
        token_losses = (-adv * r + torch.where(chosen, self.kl_coef * log_r.abs(), 0.0)) * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            metrics = {
                **ratio_metrics(r, log_r, mask, valid),
                "cov_mean": masked_mean(cov, mask),
                "kl_cov_frac": masked_mean(chosen.to(mask.dtype), mask),
                "kl_cov_penalty": masked_mean(torch.where(chosen, log_r.abs(), 0.0), mask),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
