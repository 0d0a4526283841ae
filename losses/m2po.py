"""M2PO: a trust region from a budget tau on the second moment of log-ratios, in two forms.

`M2PO` (paper form, "Prosperity before Collapse", arXiv 2510.01161): m2_t = (log pi_t - log mu_t)^2. If the batch
mean of m2 over the loss mask exceeds tau, mask (M_t = 0) the tokens with the largest m2 until the mean over the rest
is <= tau; the loss is PG-IS on the rest, l_t = -A_t r_t M_t (c_t = r_t M_t). Masked tokens leave the returned mask.

`M2POClip` (AstraFlow's code form, "m2po_clip"; arXiv 2605.15565): Delta_t = log pi_old - log pi, m2_t = Delta_t^2,
with pi_old the behaviour log-probs, or the trainer's proximal forward when `recompute=True` (then the
ratio r = pi / pi_old is anchored on it too). Among the tokens moving away from the anchor ((A > 0 and r > 1) or
(A < 0 and r < 1)): if their mean m2 <= tau nothing is clipped (PG-IS); otherwise drop the largest m2 until the rest's
mean is <= tau, m2_c = the smallest dropped value, tau' = sqrt(m2_c), and apply PPO's clip with
eps_low = min(1 - e^-tau', 0.95), eps_high = min(e^tau' - 1, 20): l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),
aggregated `token-mean`. The bounds are batch statistics, detached like PPO's constant eps. The smallest dropped token
sits on the bound itself (|log r| = tau' up to rounding); tokens beyond it lose their gradient.

Both are batch-wide statistics (`batch_statistics = True`): every count and sum goes through `LossInputs.reduce` (sum
over DDP ranks). The greedy "drop the largest" is computed without gathering tokens, by `second_moment_cut`: a
bisection over the float32 bit patterns of m2 (non-negative floats order like their bits) for the largest threshold
theta with sum(m2 <= theta) <= tau * count(m2 <= theta); 31 steps pin it exactly, each one all-reduce of two numbers.
Its kept set {m2 <= theta} equals the sort-based definition whenever the values at the cut are distinct; tokens tied
at the cut are kept or dropped together. m2 is evaluated in float32, its sums in float64. "The batch" is what one
loss call sees, summed over ranks: `PolicyModule` calls it once on the whole step's batch even when it
micro-batches (`trainer.micro_batch_tokens`), so the cut is the whole batch's. Default tau = 0.01
(math, code); AstraFlow uses 0.004 for agent tasks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.losses._common import clip_metrics, log_ratio, ratio_metrics, sanitize, tokens

_INF_BITS = 0x7F800000  # float32 +inf as int32 bits; every finite m2 >= 0 has smaller bits


def second_moment_cut(m2: torch.Tensor, select: torch.Tensor, tau: float,
                      reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy second-moment cut over `select` tokens on all ranks. Returns (keep [B, T] bool, cut [] float32).

    keep = select & (m2 <= theta), theta the largest threshold whose kept mean is <= tau: the same set as sorting m2
    descending and dropping from the top until the rest's mean is <= tau. cut = the smallest dropped m2 (+inf when
    nothing is dropped). No host sync, no gather; `reduce` sums over ranks (None = this process only).
    """
    red = reduce if reduce is not None else (lambda x: x)
    m2 = m2.detach().float()  # [B, T]
    key = m2.contiguous().view(torch.int32)  # [B, T] monotone in m2 for m2 >= 0
    count_w = select.to(torch.float64)  # [B, T]
    sum_w = m2.to(torch.float64) * count_w  # [B, T]
    # cond(K): kept set {key <= K} has mean <= tau. It holds at K = 0 (only m2 == 0) and is monotone (true, then
    # false): adding a value >= every kept value never lowers the mean. Find the largest K with cond(K).
    lo = torch.zeros((), dtype=torch.int64, device=m2.device)
    hi = torch.full((), _INF_BITS, dtype=torch.int64, device=m2.device)
    for _ in range(31):  # the interval [lo, hi] holds < 2^31 values and halves each step
        mid = (lo + hi + 1) // 2
        inside = key <= mid  # [B, T]
        count, total = red(torch.stack([(count_w * inside).sum(), (sum_w * inside).sum()]))
        ok = total <= tau * count
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    keep = select & (key <= lo)  # [B, T]
    # cond fails at lo + 1, so the kept set grows there: some selected token has exactly those bits (the smallest drop)
    cut = (lo + 1).clamp(max=_INF_BITS).to(torch.int32).view(torch.float32)
    return keep, cut


def _sums(reduce, *xs: torch.Tensor) -> torch.Tensor:
    """One all-reduce of several float64 sums."""
    stacked = torch.stack([x.to(torch.float64).sum() for x in xs])
    return reduce(stacked) if reduce is not None else stacked


def _check_tau(tau: float) -> float:
    if not tau > 0:  # also rejects NaN
        raise ValueError(f"tau must be > 0 (the budget on the batch mean of (log pi - log pi_old)^2); got {tau}. "
                         "M2PO uses 0.01 for math and code, 0.004 for agent tasks")
    return float(tau)


class M2PO(PolicyLoss):
    """M2PO paper form: PG-IS with the largest-m2 tokens masked until the batch mean m2 <= tau (arXiv 2510.01161).

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[0.0, 0.1, -0.5, 1.0]], requires_grad=True)  # mu = 1: m2 = (0, 0.01, 0.25, 1)
        >>> out = M2PO(tau=0.1)(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 4),
        ...                                advantages=torch.ones(1, 4), loss_mask=torch.ones(1, 4)))
        >>> out.mask.tolist()  # mean(all) = 0.315, mean without 1 = 0.0867 <= 0.1
        [[1.0, 1.0, 1.0, 0.0]]
    """

    batch_statistics = True

    def __init__(self, tau: float = 0.01) -> None:
        self.tau = _check_tau(tau)

    def __repr__(self) -> str:
        return f"M2PO(tau={self.tau})"

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, _, _, adv, log_r, r = tokens(inputs)  # [B, T] each; r anchored on mu, not truncated
        m2 = log_r.detach() ** 2  # [B, T]
        keep, _ = second_moment_cut(m2, valid, self.tau, inputs.reduce)
        kept = mask * keep.to(mask.dtype)  # [B, T] effective mask: dropped tokens leave the denominator
        token_losses = -adv * r * kept  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            n, s, n_kept, s_kept = _sums(inputs.reduce, mask, m2 * mask, kept, m2 * kept)  # global over ranks
            metrics = {
                "m2_mean": (s / n.clamp_min(1.0)).to(mask.dtype),
                "m2_mean_kept": (s_kept / n_kept.clamp_min(1.0)).to(mask.dtype),
                "mask_frac": ((n - n_kept) / n.clamp_min(1.0)).to(mask.dtype),
                **ratio_metrics(r, log_r, mask, valid),
            }
        return LossOutputs(token_losses=token_losses, mask=kept, metrics=metrics)


class M2POClip(PolicyLoss):
    """M2PO as AstraFlow's code runs it: a PPO clip whose bound tau' comes from the second-moment budget.

    Example:
        >>> import torch
        >>> from astratk.contracts import LossInputs
        >>> lp = torch.tensor([[0.1, 0.2, 0.5, -0.3]], requires_grad=True)  # mu = 1: log r = lp
        >>> out = M2POClip(tau=0.02)(LossInputs(logprobs=lp, behavior_logprobs=torch.zeros(1, 4),
        ...                                     advantages=torch.ones(1, 4), loss_mask=torch.ones(1, 4)))
        >>> round(out.metrics["tau_prime"].item(), 4)  # away m2 (.01, .04, .25): drop .25, then .04: sqrt(.04)
        0.2
    """

    required_aggregation = "token-mean"
    batch_statistics = True

    def __init__(self, tau: float = 0.01, recompute: bool = False, eps_low_cap: float = 0.95,
                 eps_high_cap: float = 20.0) -> None:
        self.tau = _check_tau(tau)
        if not 0 < eps_low_cap < 1:
            raise ValueError(f"eps_low_cap must be in (0, 1) (r is never clipped below 1 - eps_low_cap > 0); got "
                             f"{eps_low_cap}. AstraFlow uses 0.95")
        if not eps_high_cap > 0:
            raise ValueError(f"eps_high_cap must be > 0 (r is never clipped above 1 + eps_high_cap); got "
                             f"{eps_high_cap}. AstraFlow uses 20")
        self.recompute, self.eps_low_cap, self.eps_high_cap = bool(recompute), float(eps_low_cap), float(eps_high_cap)
        self.needs_proximal = self.recompute  # the trainer fills proximal_logprobs only when asked

    def __repr__(self) -> str:
        return (f"M2POClip(tau={self.tau}, recompute={self.recompute}, eps_low_cap={self.eps_low_cap}, "
                f"eps_high_cap={self.eps_high_cap})")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        valid, mask, logp, logmu, adv, _, _ = tokens(inputs)  # [B, T] each
        if self.recompute:
            if inputs.proximal_logprobs is None:
                raise ValueError("M2POClip(recompute=True) needs LossInputs.proximal_logprobs (the trainer's no-grad "
                                 "forward at the step start); the trainer fills it when loss.needs_proximal is True")
            logmu = sanitize(inputs.proximal_logprobs.detach(), valid)  # [B, T] pi_old
        log_r = log_ratio(logp, logmu)  # [B, T] = -Delta
        r = torch.exp(log_r)  # [B, T]
        away = valid & (((adv > 0) & (r > 1.0)) | ((adv < 0) & (r < 1.0)))  # [B, T] moving away from the anchor
        _, cut = second_moment_cut(log_r.detach() ** 2, away, self.tau, inputs.reduce)
        tau_p = cut.to(r.dtype).sqrt()  # [] +inf when nothing was dropped: no clip
        clipping = torch.isfinite(tau_p)
        lower = torch.where(clipping, 1.0 - (1.0 - torch.exp(-tau_p)).clamp(max=self.eps_low_cap), 0.0)
        upper = torch.where(clipping, 1.0 + torch.expm1(tau_p).clamp(max=self.eps_high_cap), float("inf"))
        loss = torch.maximum(-adv * r, -adv * r.clamp(lower, upper))  # [B, T]
        token_losses = loss * mask  # [B, T]
        if inputs.weights is not None:
            token_losses = token_losses * inputs.weights.detach()
        with torch.no_grad():
            low, high = (adv < 0) & (r < lower), (adv > 0) & (r > upper)  # [B, T] gradient removed
            n_away, s_away = _sums(inputs.reduce, away, (log_r ** 2) * away)
            metrics = {
                "tau_prime": torch.where(clipping, tau_p, 0.0),
                "clip_active": clipping.to(mask.dtype),
                "m2_away_mean": (s_away / n_away.clamp_min(1.0)).to(mask.dtype),
                **clip_metrics(low, high, mask),
                **ratio_metrics(r, log_r, mask, valid),
            }
        return LossOutputs(token_losses=token_losses, mask=mask, metrics=metrics)
