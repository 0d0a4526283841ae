"""Ratio math shared by the losses (kept tiny on purpose: losses may share a line of ratio math, no more)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from astratk.contracts import LossInputs

LOG_RATIO_CLAMP = 20.0  # clamp log r to [-20, 20] before exp (docs/architecture.md)


def sanitize(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Zero the masked-out positions, so garbage there (NaN, -inf padding) reaches neither the loss nor the gradient.

    `masked_fill` has zero gradient at the filled positions; multiplying by the mask afterwards would not be enough
    (NaN * 0 = NaN, in the forward and in the backward).
    """
    return x.masked_fill(~valid, 0.0)


def log_ratio(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
    """log r = clamp(log pi - log mu, -20, 20), with mu detached (the rollout anchor)."""
    return (logprobs - behavior_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def k3_kl(log_r: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(mu || pi): (r - 1) - log r >= 0."""
    return torch.expm1(log_r) - log_r


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean over mask tokens; 0 (not NaN) for an all-zero mask. A dot product: one pass, no [B, T] buffer
    (diagnostics are computed every step on every token, so they must cost little next to the loss itself)."""
    m = mask.to(x.dtype if x.dtype.is_floating_point else torch.float32)
    x = x.detach().to(m.dtype)
    return torch.dot(x.reshape(-1), m.reshape(-1)) / m.sum().clamp_min(1.0)


def masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Detached max over valid tokens; 0 for none (torch.where, not `if`, so no host sync on GPU)."""
    x = x.detach()
    return torch.where(valid.any(), x.masked_fill(~valid, float("-inf")).max(), x.new_zeros(()))


def masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return -masked_max(-x, valid)


class Tokens(NamedTuple):
    """The per-token view every loss starts from: masked inputs, the rollout-anchored ratio. All [B, T]."""

    valid: torch.Tensor  # bool, the tokens that count
    mask: torch.Tensor  # float in logprobs' dtype
    logp: torch.Tensor  # log pi, gradient flows here
    logmu: torch.Tensor  # log mu, detached
    adv: torch.Tensor  # advantages, detached
    log_r: torch.Tensor  # clamped log pi - log mu
    r: torch.Tensor  # exp(log_r), not truncated


def tokens(inputs: LossInputs) -> Tokens:
    valid = inputs.loss_mask.bool()
    logp = sanitize(inputs.logprobs, valid)
    logmu = sanitize(inputs.behavior_logprobs.detach(), valid)
    log_r = log_ratio(logp, logmu)
    return Tokens(valid=valid, mask=inputs.loss_mask.to(inputs.logprobs.dtype), logp=logp, logmu=logmu,
                  adv=sanitize(inputs.advantages.detach(), valid), log_r=log_r, r=torch.exp(log_r))


def ratio_metrics(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """The diagnostics every ratio-based loss reports: ratio mean and max, k3 KL(mu || pi)."""
    return {"ratio_mean": masked_mean(r, mask), "ratio_max": masked_max(r, valid),
            "kl_k3": masked_mean(k3_kl(log_r.detach()), mask)}


def clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fractions of tokens a clip removed the gradient of: below (A < 0), above (A > 0), either."""
    return {"clip_frac": masked_mean(low | high, mask), "clip_frac_low": masked_mean(low, mask),
            "clip_frac_high": masked_mean(high, mask)}
