"""Training–inference mismatch corrections as composable per-token weights.

The engine that sampled (μ) and the trainer (π) disagree a little even at the same weights (kernels, precision,
batching). A correction compares the trainer's own no-grad log-probs π_old (the *proximal* policy:
the trainer's forward on the step's batch at the start of the step's first mini-batch, filled into
`LossInputs.proximal_logprobs`) with μ, per token, and returns

- `weights` [B, T], detached: multiplied into `LossInputs.weights` (they scale token losses, not the denominator);
- `keep` [B, T], 0/1: multiplied into `LossInputs.loss_mask`, so dropped tokens also leave the aggregation
  denominator (the loss returns the reduced mask as its effective mask);
- `metrics`: detached scalars, which the trainer reports as `correction/<name>/<metric>`.

Why π_old and not π at the exact rollout weights: every token carries its own behaviour version (asynchronous
rollouts, weight updates mid-generation), so recomputing π at each token's own weights would need one forward per
version; the proximal forward at the current weights is the practical stand-in, as in AReaL's decoupled PPO.

Levels: `token` uses ρ_t = π_old/μ per token; `sequence` uses the product ρ_i = exp(Σ_t m_t log ρ_t) for the whole
sequence (broadcast over its tokens); `geometric` uses the per-token geometric mean exp(Σ_t m_t log ρ_t / n_i), which
stays near 1 on long sequences. log ρ is clamped to [-20, 20] per token and per sequence before any exp.

Built-ins: `TIS` (truncated IS, w = min(ρ, C)) and `MIS` (masked IS / IcePop, keep = 1[low ≤ ρ ≤ high]).
Extending: subclass `TokenCorrection`, give it a `name`, implement `__call__` with the helpers below, and add a short
name in `astratk/registry.py` under kind "correction" (a config may also give the dotted path).
"""

from __future__ import annotations

import torch

from astratk.contracts import CorrectionOutput, LossInputs, TokenCorrection
from astratk.losses._common import LOG_RATIO_CLAMP, masked_max, masked_mean, sanitize
from astratk.registry import check_choice

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")


def proximal_log_ratio(inputs: LossInputs, level: str, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ρ [B, T], valid [B, T] bool): log(π_old/μ) per token, or its sequence value broadcast over the row.

    Masked positions hold 0 (ρ = 1). Raises if the trainer did not fill `proximal_logprobs`.
    """
    if inputs.proximal_logprobs is None:
        raise ValueError(f"{who} needs LossInputs.proximal_logprobs (π_old, the trainer's no-grad forward at the start "
                         "of the step); PolicyModule fills it when a correction is configured. When "
                         "calling it directly, pass proximal_logprobs=<[B, T] log-probs>")
    valid = inputs.loss_mask.bool()  # [B, T]
    prox = sanitize(inputs.proximal_logprobs.detach(), valid)
    mu = sanitize(inputs.behavior_logprobs.detach(), valid)
    log_rho = (prox - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    if level == "token":
        return log_rho, valid
    seq = log_rho.sum(-1, keepdim=True)  # [B, 1]
    if level == "geometric":
        seq = seq / valid.sum(-1, keepdim=True).clamp_min(1)
    seq = seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return sanitize(seq.expand_as(log_rho), valid), valid


def _check_level(level: str, who: str) -> str:
    return check_choice("level", level, LEVELS, where=who)


def _unit_mean(x: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """Mean over tokens (token level) or over non-empty sequences (sequence levels, x constant on a row)."""
    if level == "token":
        return masked_mean(x, valid)
    rows = valid.any(-1)  # [B]
    per_row = x.detach().masked_fill(~valid, 0).sum(-1) / valid.sum(-1).clamp_min(1)  # [B] the row's value
    return masked_mean(per_row, rows)


class TIS(TokenCorrection):
    """Truncated importance sampling: w = min(π_old/μ, C), per token or per sequence.

    Example:
        >>> import torch
        >>> from astratk.contracts import CorrectionOutput, LossInputs, TokenCorrection
        >>> z = torch.zeros(1, 2)
        >>> out = TIS(cap=2.0)(LossInputs(z, torch.log(torch.tensor([[0.5, 0.1]])), z, torch.ones(1, 2),
        ...                                proximal_logprobs=z))
        >>> [round(v, 4) for v in out.weights.tolist()[0]]  # rho = 1 / mu = 2 and 10, capped at 2
        [2.0, 2.0]
    """

    name = "tis"

    def __init__(self, cap: float = 2.0, level: str = "token") -> None:
        if not cap > 0:
            raise ValueError(f"TIS cap must be > 0 (w = min(pi_old / mu, cap)); got {cap}. The usual value is 2")
        self.cap = float(cap)
        self.level = _check_level(level, "TIS")

    def __repr__(self) -> str:
        return f"TIS(cap={self.cap}, level={self.level!r})"

    def __call__(self, inputs: LossInputs) -> CorrectionOutput:
        log_rho, valid = proximal_log_ratio(inputs, self.level, "TIS")  # [B, T]
        log_cap = torch.log(torch.tensor(self.cap, dtype=log_rho.dtype, device=log_rho.device))
        w = torch.exp(torch.minimum(log_rho, log_cap)).masked_fill(~valid, 1.0)  # [B, T] min(rho, C), no overflow
        rho = torch.exp(log_rho)
        metrics = {
            "ratio_mean": _unit_mean(rho, valid, self.level),
            "ratio_max": masked_max(rho, valid),
            "weight_mean": _unit_mean(w, valid, self.level),
            "truncated_frac": _unit_mean((log_rho > log_cap).to(rho.dtype), valid, self.level),
        }
        return CorrectionOutput(weights=w.detach(), keep=torch.ones_like(w), metrics=metrics)


class MIS(TokenCorrection):
    """Masked importance sampling (IcePop): tokens, or whole sequences, whose ρ = π_old/μ lies outside [low, high]
    are dropped from the loss and from its denominator; inside the band they are weighted by ρ, as
    in IcePop's M(k) = k·1[α ≤ k ≤ β] (`weight=False`: keep the mask only, weight 1, i.e. plain rejection).

    Example:
        >>> import torch
        >>> from astratk.contracts import CorrectionOutput, LossInputs, TokenCorrection
        >>> z = torch.zeros(1, 3)
        >>> mu = torch.log(torch.tensor([[1.0, 0.8, 0.1]]))  # rho = 1, 1.25, 10
        >>> out = MIS(low=0.5, high=2.0)(LossInputs(z, mu, z, torch.ones(1, 3), proximal_logprobs=z))
        >>> out.keep.tolist()[0], [round(v, 4) for v in out.weights.tolist()[0]]
        ([1.0, 1.0, 0.0], [1.0, 1.25, 1.0])
    """

    name = "mis"

    def __init__(self, low: float = 0.5, high: float = 2.0, level: str = "token", weight: bool = True) -> None:
        if not 0 <= low < 1 < high:
            raise ValueError(f"MIS needs 0 <= low < 1 < high (the band of pi_old / mu kept); got low={low}, "
                             f"high={high}. IcePop uses [0.5, 2]")
        self.low, self.high = float(low), float(high)
        self.level = _check_level(level, "MIS")
        self.weight = bool(weight)
        self.reweights = self.weight  # weight=False only masks: it composes with a loss that weights by itself

    def __repr__(self) -> str:
        return f"MIS(low={self.low}, high={self.high}, level={self.level!r}, weight={self.weight})"

    def __call__(self, inputs: LossInputs) -> CorrectionOutput:
        log_rho, valid = proximal_log_ratio(inputs, self.level, "MIS")  # [B, T]
        rho = torch.exp(log_rho)
        inside = (rho >= self.low) & (rho <= self.high)  # [B, T]
        keep = (inside | ~valid).to(log_rho.dtype)  # off-mask positions stay as they are (mask 0 anyway)
        w = torch.where(inside & valid, rho, torch.ones_like(rho)) if self.weight else torch.ones_like(rho)
        metrics = {
            "ratio_mean": _unit_mean(rho, valid, self.level),
            "ratio_max": masked_max(rho, valid),
            "dropped_frac": _unit_mean((~inside).to(rho.dtype), valid, self.level),
            "dropped_tokens": (valid & ~inside).sum().to(rho.dtype),
        }
        return CorrectionOutput(weights=w.detach(), keep=keep.detach(), metrics=metrics)
