"""DPPO: divergence trust region with a hard mask (arXiv 2602.04879).

Per token, with r = pi / mu anchored on the rollout engine's log-probs (log r clamped to +-20):

    M_t = 0  iff  (A > 0 and pi > mu and D_t > delta)  or  (A < 0 and pi < mu and D_t > delta),  else 1
    l_t = -A_t * sg(min(r_t, C)) * M_t * log pi_t            (the authors' form; sg(r) when C is None)

so the gradient coefficient on A grad log pi is min(r, C) * M: a token moving *away* from mu beyond the divergence
radius gets exactly zero gradient; a token moving back toward mu is never masked. D and M carry no gradient.
Divergences D_t (arXiv 2602.04879, §4 and App. B), all estimated on partitions of the vocabulary, so each is a lower
bound of the true divergence (Binary <= Top-K <= full vocabulary):
- binary_tv: |pi - mu| (cells {sampled, rest}; the 1/2 cancels on two cells). Default delta 0.15.
- binary_kl: mu log(mu / pi) + (1 - mu) log((1 - mu + 1e-8) / (1 - pi + 1e-8)). Default delta 0.05.
- topk_tv / topk_kl: cells = the engine's top-K tokens, the sampled token, and one "rest" cell (1 - the others,
  clamped at 1e-12); TV = 1/2 sum |p_mu - p_pi|, KL = sum p_mu log(p_mu / p_pi). The paper found no gain over Binary.
C (`clip_ratio`) truncates the ratio: 5 in the paper's scaling runs, 10 in the authors' code; None disables it.
Asymmetric thresholds: `delta_high` bounds tokens whose probability rises (A > 0, pi > the anchor) and `delta_low`
tokens whose probability falls (A < 0, pi < the anchor); each defaults to `delta`. A larger delta_high lets rare
tokens be reinforced further before the mask binds, as DAPO's clip-higher does for PPO's ratio.
anchor="recompute" (ablation only; the paper's Takeaway 2 is that it collapses): the trust region (the divergence
D_t and the direction test) is measured against the trainer's proximal log-probs pi_old (its no-grad forward at the
start of the step) while the ratio r = pi / mu stays anchored on the engine, so the update is still importance
weighted for the distribution that sampled. What changes is only *which* policy the region is centred on.

Notes:
- The scalar value of l_t is NOT the surrogate's value (-A r M); only the gradients agree (where r <= C). Compare
  gradients, not losses, across implementations.
- Masked tokens keep their place in the returned mask (the aggregation denominator); only their gradient is 0.
- Top-K: the sampled token (LossInputs.sampled_ids) is matched to the top-K entries by token id (topk_ids). A
  top-K entry with the sampled id is dropped, since the sampled cell already holds that token (with the sampled
  token's own log mu and log pi); a sampled token outside the top-K is one extra cell. Ids, not log-probs: two top-K
  entries often have equal log mu (bf16 logits tie), and matching the nearest log mu would then drop the other
  entry and count the sampled token twice, shrinking (even negating, for KL) the divergence. Missing top-K entries
  must be padded with log mu = -inf (zero mass; their ids do not matter). topk_logprobs are used without gradient.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import masked_max, masked_mean, ratio_metrics, tokens

DIVERGENCES = ("binary_kl", "binary_tv", "topk_kl", "topk_tv")
ANCHORS = ("behavior", "recompute")
MAX_TOP_K = 20  # what inference engines return (vLLM's default max_logprobs); the paper's K
REST_FLOOR = 1e-12  # clamp on the "rest" cell's mass
BINARY_KL_EPS = 1e-8  # inside the (1 - p) logs of Binary-KL


def binary_divergence(kind: str, logp: torch.Tensor, logmu: torch.Tensor, pi: torch.Tensor | None = None,
                      mu: torch.Tensor | None = None) -> torch.Tensor:
    """Binary-TV or Binary-KL ("tv" / "kl") between pi and mu on {sampled, rest}. [B, T], [B, T] -> [B, T], detached.
    `pi` / `mu` = exp(logp) / exp(logmu) when the caller already has them (saves two exps per token)."""
    logp, logmu = logp.detach(), logmu.detach()
    pi = logp.exp() if pi is None else pi
    mu = logmu.exp() if mu is None else mu
    if kind == "tv":
        return (pi - mu).abs_()
    one_minus_mu, one_minus_pi = torch.expm1(logmu).neg_(), torch.expm1(logp).neg_()  # 1 - p, accurate near p = 1
    # log((1 - mu + eps) / (1 - pi + eps)) = log1p((pi - mu) / (1 - pi + eps)): one log instead of two
    log_ratio_rest = torch.log1p((pi - mu).div_(one_minus_pi.add_(BINARY_KL_EPS)))
    return torch.addcmul(one_minus_mu.mul_(log_ratio_rest), mu, logmu - logp)


def topk_divergence(kind: str, logp: torch.Tensor, logmu: torch.Tensor, topk_logp: torch.Tensor,
                    topk_logmu: torch.Tensor, topk_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """Top-K TV or KL on {top-K of mu, sampled, rest}. [B, T], [B, T], [B, T, K], [B, T, K], [B, T, K] int,
    [B, T] int -> [B, T], detached. The top-K entry whose id is the sampled one is dropped (module docstring)."""
    logp, logmu, topk_logp, topk_logmu = (x.detach() for x in (logp, logmu, topk_logp, topk_logmu))
    dup = topk_ids == sampled_ids.unsqueeze(-1)  # [B, T, K] the sampled token's own top-K entry, if any

    def cells(top: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:  # -> [B, T, K + 2] probabilities
        p = torch.cat([top.exp().masked_fill(dup, 0.0), sampled.exp().unsqueeze(-1)], dim=-1)  # [B, T, K + 1]
        return torch.cat([p, (1.0 - p.sum(-1, keepdim=True)).clamp_min(REST_FLOOR)], dim=-1)

    p_mu, p_pi = cells(topk_logmu, logmu), cells(topk_logp, logp)
    if kind == "tv":
        return 0.5 * (p_mu - p_pi).abs().sum(-1)
    return (torch.xlogy(p_mu, p_mu) - torch.xlogy(p_mu, p_pi.clamp_min(REST_FLOOR))).sum(-1)


def dppo_keep(adv: torch.Tensor, logp: torch.Tensor, logmu: torch.Tensor, div: torch.Tensor,
              delta_high: float, delta_low: float | None = None) -> torch.Tensor:
    """M_t as bool [B, T]: False iff the token moves away from the anchor (sign of A) and D_t exceeds the threshold
    of its direction: `delta_high` for tokens rising (A > 0, pi > anchor), `delta_low` (default: the same) for
    tokens falling (A < 0, pi < anchor)."""
    delta_low = delta_high if delta_low is None else delta_low
    up = (adv > 0) & (logp > logmu) & (div > delta_high)
    down = (adv < 0) & (logp < logmu) & (div > delta_low)
    return ~(up | down)


class DPPO(PolicyLoss):
    """DPPO per-token loss (arXiv 2602.04879). Pair with `seq-mean-token-sum-norm` and Dr.GRPO advantages.

    Example (delta 0.15: token 0 moves mu 0.5 -> pi 0.7 with A > 0, |pi - mu| = 0.2 > 0.15, so it is masked; token 1
    moves to 0.6, inside the region, and gets the full gradient -A r = -1.2):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[0.7, 0.6]])).requires_grad_()
        >>> out = DPPO()(LossInputs(logprobs=lp, behavior_logprobs=torch.log(torch.tensor([[0.5, 0.5]])),
        ...                         advantages=torch.tensor([[1.0, 1.0]]), loss_mask=torch.ones(1, 2)))
        >>> out.token_losses.sum().backward()
        >>> lp.grad[0, 0].item() == 0.0, round(lp.grad[0, 1].item(), 4)
        (True, -1.2)
        >>> round(out.metrics["masked_frac"].item(), 4), out.mask.tolist()  # masked tokens stay in the denominator
        (0.5, [[1.0, 1.0]])
    """

    def __init__(self, divergence: str = "binary_tv", delta: float | None = None, clip_ratio: float | None = None,
                 anchor: str = "behavior", top_k: int = 20, delta_low: float | None = None,
                 delta_high: float | None = None) -> None:
        if divergence not in DIVERGENCES:
            raise ValueError(f"unknown DPPO divergence {divergence!r}; choose one of {sorted(DIVERGENCES)} "
                             "(binary_tv is the paper's default)")
        if delta is None:
            delta = 0.15 if divergence.endswith("tv") else 0.05
        if not delta > 0:  # also rejects NaN
            raise ValueError(f"delta must be > 0 (the divergence radius of the trust region); got "
                             f"{delta}. The paper uses 0.15 (or 0.2) for TV and 0.05 for KL; None picks these")
        for name, value in (("delta_low", delta_low), ("delta_high", delta_high)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (the divergence radius for tokens whose probability "
                                 f"{'falls' if name == 'delta_low' else 'rises'}); got {value}. None uses delta "
                                 f"({delta})")
        if clip_ratio is not None and not clip_ratio >= 1:
            raise ValueError(f"clip_ratio must be >= 1 (C truncates r; C < 1 would truncate on-policy tokens, r = 1); "
                             f"got {clip_ratio}. The paper uses 5 (scaling runs) or 10 (code); None disables it")
        if anchor not in ANCHORS:
            raise ValueError(f"unknown DPPO anchor {anchor!r}; choose one of {list(ANCHORS)} ('behavior', the engine's "
                             "log-probs, is the paper's recommendation; 'recompute' is an ablation)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an int in [1, {MAX_TOP_K}] (engines return at most {MAX_TOP_K} "
                             f"log-probs per position); got {top_k!r}")
        if anchor == "recompute" and divergence.startswith("topk"):
            raise ValueError(f"DPPO(divergence={divergence!r}, anchor='recompute') is not supported: the trainer "
                             "does not compute top-K log-probs at the proximal weights. Use anchor='behavior' (the "
                             "paper's recommendation) or a binary divergence")
        self.divergence, self.delta, self.anchor, self.top_k = divergence, float(delta), anchor, top_k
        self.delta_low = self.delta if delta_low is None else float(delta_low)
        self.delta_high = self.delta if delta_high is None else float(delta_high)
        self.clip_ratio = None if clip_ratio is None else float(clip_ratio)
        self.needs_proximal = anchor == "recompute"  # trainer declarations (PolicyLoss), per instance
        self.needs_topk = top_k if divergence.startswith("topk") else 0

    def __repr__(self) -> str:
        extra = "" if self.delta_low == self.delta_high == self.delta else (
            f", delta_low={self.delta_low}, delta_high={self.delta_high}")
        return (f"{type(self).__name__}(divergence={self.divergence!r}, delta={self.delta}, "
                f"clip_ratio={self.clip_ratio}, anchor={self.anchor!r}, top_k={self.top_k}{extra})")

    def _anchor(self, inputs: LossInputs) -> torch.Tensor:
        if self.anchor == "behavior":
            return inputs.behavior_logprobs
        if inputs.proximal_logprobs is None:
            raise ValueError("DPPO(anchor='recompute') needs LossInputs.proximal_logprobs [B, T] (the trainer fills it "
                             "when loss.needs_proximal is True); or use anchor='behavior'")
        return inputs.proximal_logprobs

    def _topk(self, inputs: LossInputs, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Top-K log pi and log mu, [B, T, K] each, with -inf (zero mass) off the valid tokens; top-K ids [B, T, K]
        and sampled ids [B, T]."""
        lp, lmu, ids, sampled = (inputs.topk_logprobs, inputs.topk_behavior_logprobs, inputs.topk_ids,
                                 inputs.sampled_ids)
        if lp is None or lmu is None or ids is None or sampled is None:
            raise ValueError(f"DPPO(divergence={self.divergence!r}) needs LossInputs.topk_ids, topk_behavior_logprobs "
                             "and topk_logprobs [B, T, K] and sampled_ids [B, T] (the trainer fills them when "
                             "loss.needs_topk > 0; sampled_ids are the targets, TrainBatch.input_ids[:, 1:])")
        if lp.shape != lmu.shape or lp.shape != ids.shape or lp.dim() != 3 or lp.shape[:2] != valid.shape:
            raise ValueError(f"top-K log-probs and ids must all be [B, T, K] with [B, T] = {list(valid.shape)}; got "
                             f"topk_logprobs {list(lp.shape)}, topk_behavior_logprobs {list(lmu.shape)}, "
                             f"topk_ids {list(ids.shape)}")
        if sampled.shape != valid.shape:
            raise ValueError(f"sampled_ids must be [B, T] = {list(valid.shape)} (the token sampled at each position, "
                             f"TrainBatch.input_ids[:, 1:]); got {list(sampled.shape)}")
        off = ~valid.unsqueeze(-1)  # [B, T, 1]
        return (lp.detach().masked_fill(off, float("-inf")), lmu.detach().masked_fill(off, float("-inf")), ids,
                sampled)

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, logmu, adv, log_r, r = tokens(inputs)  # [B, T] each; r = pi / mu, the engine's mu
        kind = self.divergence.split("_")[1]
        with torch.no_grad():
            if self.anchor == "behavior":
                log_anchor = logmu
            else:  # the trust region's centre only; r stays pi / mu
                log_anchor = tokens(replace(inputs, behavior_logprobs=self._anchor(inputs))).logmu  # [B, T]
            pi, anchor_p = logp.detach().exp(), log_anchor.exp()  # [B, T] each, shared by divergence and metrics
            if self.divergence.startswith("topk"):
                div = topk_divergence(kind, logp, log_anchor, *self._topk(inputs, valid))  # [B, T]
            else:
                div = binary_divergence(kind, logp, log_anchor, pi, anchor_p)  # [B, T]
            # [B, T] bool; True off the mask (A = 0 there)
            keep = dppo_keep(adv, logp, log_anchor, div, self.delta_high, self.delta_low)
            ratio = r if self.clip_ratio is None else r.clamp(max=self.clip_ratio)  # [B, T] sg(min(r, C))
            coef = adv * ratio * keep.to(r.dtype)  # [B, T]
        token_losses = -coef * logp * mask  # [B, T]; gradient -A sg(min(r, C)) M on log pi
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():
            masked = (~keep).to(mask.dtype)  # [B, T] 1 where DPPO removed the gradient
            mu = logmu.exp()
            metrics = {
                "masked_frac": masked_mean(masked, mask),
                "masked_frac_pos": masked_mean(masked, valid & (adv > 0)),
                "masked_frac_neg": masked_mean(masked, valid & (adv < 0)),
                "divergence_mean": masked_mean(div, mask),
                "divergence_max": masked_max(div, valid),
                **ratio_metrics(r, log_r, mask, valid),
                "tv_mean": masked_mean((pi - mu).abs_(), mask),  # mean |pi - mu| (the engine's mu): drift
            }
            if self.anchor == "recompute":  # how far the trust region's centre sits from the sampling policy
                metrics["anchor_tv_mean"] = masked_mean((anchor_p - mu).abs_(), mask)
            if self.clip_ratio is not None:
                metrics["truncated_frac"] = masked_mean((r > self.clip_ratio).to(mask.dtype), mask)
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)


class DPPOBinaryKL(DPPO):
    """DPPO with the Binary-KL divergence (registry `dppo_kl`); delta defaults to 0.05."""

    def __init__(self, delta: float | None = None, clip_ratio: float | None = None, anchor: str = "behavior",
                 delta_low: float | None = None, delta_high: float | None = None) -> None:
        super().__init__("binary_kl", delta, clip_ratio, anchor, delta_low=delta_low, delta_high=delta_high)


class DPPOTopKTV(DPPO):
    """DPPO with the Top-K TV divergence (registry `dppo_topk_tv`); delta defaults to 0.15."""

    def __init__(self, delta: float | None = None, clip_ratio: float | None = None, top_k: int = 20,
                 delta_low: float | None = None, delta_high: float | None = None) -> None:
        super().__init__("topk_tv", delta, clip_ratio, "behavior", top_k, delta_low, delta_high)


class DPPOTopKKL(DPPO):
    """DPPO with the Top-K KL divergence (registry `dppo_topk_kl`); delta defaults to 0.05."""

    def __init__(self, delta: float | None = None, clip_ratio: float | None = None, top_k: int = 20,
                 delta_low: float | None = None, delta_high: float | None = None) -> None:
        super().__init__("topk_kl", delta, clip_ratio, "behavior", top_k, delta_low, delta_high)
