"""Decoupled PPO: the trust region on a recomputed proximal policy, the importance weight on the behaviour policy
(AReaL, arXiv 2505.24298, §4 "decoupled PPO objective").

Asynchronous training samples with a behaviour policy mu that may be several versions old. Naive PPO centres its clip
on mu, so the further mu lags, the tighter the clip binds around an outdated policy. The decoupled objective separates
the two jobs of the ratio: the *trust region* is centred on the proximal policy pi_prox (a recent policy: here the
trainer's own no-grad forward at the start of the step), and the *off-policy correction* is the importance weight
pi_prox / mu, which carries no gradient. Per token (logs clamped to +-20 before exp):

    u_t = pi_t / pi_prox_t                       the proximal ratio, clipped as in PPO
    w_t = sg(pi_prox_t / mu_t)                   the behaviour importance weight
    l_t = w_t * max(-A_t u_t, -A_t clip(u_t, 1 - eps_low, 1 + eps_high))

so the gradient coefficient on A grad log pi is w_t u_t (= pi / mu, the true importance weight), except 0 where
(A > 0 and u > 1 + eps_high) or (A < 0 and u < 1 - eps_low). With mu = pi_prox (a synchronous run) it is exactly
`PPOClip` anchored on mu. AReaL reports it holding AIME24 41-42 up to staleness 8 where naive PPO falls from 42.0 to
23.3 at staleness 4.

Options (all off by default, so the default is AReaL's objective):

- `weight_level`: "token" (the default: w_t per token, as above), "sequence" (w_i = sg(prod_t pi_prox_t / mu_t), one
  weight for the whole sequence, broadcast over its tokens: the unbiased sequence-level importance weight, which
  grows or shrinks exponentially with length) or "geometric" (w_i = sg(exp(mean_t log(pi_prox_t / mu_t))), the
  per-token geometric mean, which stays near 1 on long sequences: GSPO's choice for its sequence ratio). Logs are
  clamped to +-20 per token and per sequence before exp.
- `behavior_weight_cap` C with `cap_mode`:
  - "mask" (AReaL's `behav_imp_weight_cap`): units whose w > C lose their gradient (loss 0) but stay in the mask,
    so aggregation denominators do not change; counted in `weight_capped_frac`;
  - "truncate": w becomes min(w, C), as truncated importance sampling (TIS) does; the token keeps a gradient, at
    most C times its on-policy one; the share truncated is `weight_capped_frac`.
  Under a sequence level the cap acts on the sequence's weight (a whole sequence is masked or truncated).
- `dual_clip` c > 1 (verl's and AReaL's dual clip): for A < 0 the per-token loss is min(l_t / w_t, -c A_t) * w_t,
  i.e. the clipped surrogate is capped at -c A, so a token whose u exploded above c (a large negative advantage on a
  token the policy now favours far more than pi_prox) gets no gradient instead of an unbounded one; counted in
  `dual_clip_frac`.

One foot-gun this loss refuses by declaration (`weights_by_behavior_ratio`): it already multiplies each token by
pi_prox / mu, which is exactly the weight that `TIS` and `MIS(weight=True)` corrections apply; combined, the weight
would be applied twice (w^2). `PolicySpec.validate()` and `PolicyModule` refuse that combination in one line (keep
`MIS(weight=False)`, whose mask composes correctly, or use this loss's own cap). The proximal forward costs one extra
no-grad forward per step (the trainer fills `LossInputs.proximal_logprobs` because `needs_proximal` is True).
pi_prox is the trainer's policy at the start of the step, not at any rollout version: with one optimiser step per
batch, u = 1 in value at that step and the clip binds only across micro-batch updates or where the proximal forward
and the gradient forward differ.
"""

from __future__ import annotations

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import (
    LOG_RATIO_CLAMP,
    clip_metrics,
    masked_max,
    masked_mean,
    ratio_metrics,
    sanitize,
    tokens,
)
from astratk.losses.corrections import LEVELS, proximal_log_ratio
from astratk.registry import check_choice

CAP_MODES: tuple[str, ...] = ("mask", "truncate")


class DecoupledPPO(PolicyLoss):
    """AReaL's decoupled PPO: clip pi / pi_prox, weight by sg(pi_prox / mu).

    Example (mu 0.25, pi_prox 0.5, pi 0.7, A = 1: u = 1.4 > 1.2 is clipped, so no gradient; w = 2 scales the value):
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.log(torch.tensor([[0.7, 0.55]])).requires_grad_()
        >>> out = DecoupledPPO()(LossInputs(logprobs=lp, behavior_logprobs=torch.log(torch.tensor([[0.25, 0.5]])),
        ...                                 advantages=torch.tensor([[1.0, 1.0]]), loss_mask=torch.ones(1, 2),
        ...                                 proximal_logprobs=torch.log(torch.tensor([[0.5, 0.5]]))))
        >>> [round(v, 4) for v in out.token_losses.tolist()[0]]  # -w * 1.2 = -2.4; -1 * 1.1
        [-2.4, -1.1]
        >>> out.token_losses.sum().backward()
        >>> [round(g, 4) for g in lp.grad.tolist()[0]]  # clipped: 0; inside: -A w u = -pi / mu = -1.1
        [0.0, -1.1]
    """

    needs_proximal = True
    weights_by_behavior_ratio = True

    def __init__(self, eps_low: float = 0.2, eps_high: float | None = None,
                 behavior_weight_cap: float | None = None, cap_mode: str = "mask", weight_level: str = "token",
                 dual_clip: float | None = None) -> None:
        eps_high = eps_low if eps_high is None else eps_high
        if not 0 < eps_low < 1:
            raise ValueError(f"eps_low must be in (0, 1) (pi / pi_prox is clipped below at 1 - eps_low); got "
                             f"{eps_low}. AReaL uses 0.2")
        if not eps_high > 0:
            raise ValueError(f"eps_high must be > 0 (pi / pi_prox is clipped above at 1 + eps_high); got {eps_high}. "
                             "Leave it None for eps_high = eps_low")
        if behavior_weight_cap is not None and not behavior_weight_cap > 1:
            raise ValueError(f"behavior_weight_cap must be > 1 (tokens with pi_prox / mu above it lose their "
                             f"gradient; <= 1 would drop on-policy tokens); got {behavior_weight_cap}. None disables it")
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (A < 0 tokens have their loss capped at -dual_clip * A; c <= 1 "
                             f"would cap tokens inside the trust region); got {dual_clip}. verl and AReaL use 3; None "
                             "disables it")
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.behavior_weight_cap = None if behavior_weight_cap is None else float(behavior_weight_cap)
        self.cap_mode = check_choice("cap_mode", cap_mode, CAP_MODES, where="DecoupledPPO")
        self.weight_level = check_choice("weight_level", weight_level, LEVELS, where="DecoupledPPO")
        self.dual_clip = None if dual_clip is None else float(dual_clip)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v, default in (
            ("cap_mode", self.cap_mode, "mask"), ("weight_level", self.weight_level, "token"),
            ("dual_clip", self.dual_clip, None)) if v != default)
        return (f"DecoupledPPO(eps_low={self.eps_low}, eps_high={self.eps_high}, "
                f"behavior_weight_cap={self.behavior_weight_cap}{extra})")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        if inputs.proximal_logprobs is None:
            raise ValueError("DecoupledPPO needs LossInputs.proximal_logprobs [B, T] (the trainer fills them because "
                             "needs_proximal is True; when calling the loss directly, pass the no-grad log-probs of "
                             "the policy the trust region is centred on)")
        valid, mask, logp, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r = pi / mu
        log_prox = sanitize(inputs.proximal_logprobs.detach(), valid)  # [B, T]
        log_u = (logp - log_prox).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T] proximal ratio, grad flows
        u = torch.exp(log_u)
        log_w, _ = proximal_log_ratio(inputs, self.weight_level, "DecoupledPPO")  # [B, T] log(pi_prox / mu)
        w_all = torch.exp(log_w)  # [B, T] detached weight, before any cap
        w = w_all
        if self.behavior_weight_cap is not None:
            capped = valid & (w_all > self.behavior_weight_cap)  # [B, T]
            w = w_all.masked_fill(capped, 0.0) if self.cap_mode == "mask" else w_all.clamp(
                max=self.behavior_weight_cap)
        loss = torch.maximum(-adv * u, -adv * u.clamp(1.0 - self.eps_low, 1.0 + self.eps_high))  # [B, T]
        if self.dual_clip is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -self.dual_clip * adv), loss)
        token_losses = w * loss * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()

        with torch.no_grad():
            low = (adv < 0) & (u < 1.0 - self.eps_low)  # [B, T] tokens whose gradient the clip removes
            high = (adv > 0) & (u > 1.0 + self.eps_high)
            metrics = {
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),  # pi / mu: the whole off-policy gap
                "behavior_weight_mean": masked_mean(w_all, mask),
                "behavior_weight_max": masked_max(w_all, valid),
                "proximal_ratio_max": masked_max(u, valid),
            }
            if self.behavior_weight_cap is not None:
                metrics["weight_capped_frac"] = masked_mean(capped.to(mask.dtype), mask)
            if self.dual_clip is not None:
                metrics["dual_clip_frac"] = masked_mean(((adv < 0) & (u > self.dual_clip)).to(mask.dtype), mask)
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
