"""Optional extra per-token terms, off by default: KL to a frozen reference
policy and the policy's entropy. Pure functions on tensors; the trainer adds them to a loss's token losses, masked,
before aggregation (`PolicyModule(kl_coef=..., entropy_coef=...)`), and reports their means when on.

Extending: add a function here with shape comments and a closed-form gradient test in tests/unit/test_regularizers.py.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from astratk.registry import check_choice

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


def check_kl_estimator(estimator: str) -> str:
    return check_choice("KL estimator", estimator, KL_ESTIMATORS, " (k3 is the non-negative, low-variance default)")


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) on tokens sampled from π: [B, T], gradient to `logprobs` only.

    With d = log π_ref − log π (clamped to [-20, 20]):
    - k1 = −d = log π − log π_ref (unbiased, can be negative); d k1 / d log π = 1;
    - k3 = e^d − d − 1 ≥ 0 (Schulman's estimator, the GRPO paper's KL term); d k3 / d log π = 1 − π_ref / π.

    Example:
        >>> import torch
        >>> lp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
        >>> round(kl_to_reference(lp, ref, "k1").item(), 4), round(kl_to_reference(lp, ref, "k3").item(), 4)
        (0.6931, 0.1931)
    """
    check_kl_estimator(estimator)
    d = (ref_logprobs.detach() - logprobs).clamp(-20.0, 20.0)  # [B, T]
    if estimator == "k1":
        return -d
    return torch.expm1(d) - d  # e^d - 1 - d, accurate near d = 0


def _entropy_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()  # [n, V]
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)  # [n, V]
    return -(logp.exp() * logp).sum(-1)  # [n]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy H = −Σ_v p_v log p_v of softmax(logits / T) at every position: [..., V] -> [...], fp32.

    Memory: the vocabulary-sized temporaries (fp32 copy, log-softmax, p log p) exist for `chunk_size` positions at a
    time, never for the whole [B, T, V] block; with gradients on, each chunk is checkpointed, so backward recomputes
    them instead of keeping them alive (the caller's logits are already held by the policy forward).
    Temperatures of 0 (greedy) count as 1, as in `logprobs_from_logits`.

    Example:
        >>> import torch
        >>> round(entropy_from_logits(torch.zeros(1, 1, 4)).item(), 4)  # uniform over 4: log 4
        1.3863
    """
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    grad = torch.is_grad_enabled() and flat.requires_grad
    parts = []
    for rows in flat.split(chunk_size):
        if grad:
            parts.append(checkpoint(_entropy_rows, rows, temperature, use_reentrant=False))
        else:
            parts.append(_entropy_rows(rows, temperature))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(shape)
