"""The pieces of one training step around the loss call: what the trainer adds to `LossInputs` before it and to the
token losses after it, each a small function so `PolicyModule.training_step` reads as a table of contents.

- `apply_corrections`: mismatch corrections in order: weights *= w, loss_mask *= keep.
- `topk_fields`: the engine's top-K ids and log-probs for a loss with `needs_topk`, or a clear error.
- `add_regularizers`: KL to a frozen reference and the entropy bonus, added
  to the per-token losses under the loss's effective mask, before aggregation.
- `sum_over_ranks`: the `LossInputs.reduce` callable for losses with batch-wide statistics under DDP.

Extending: a new per-step input is a function here plus a line in `training_step`; keep the algorithm itself in
`losses/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from astratk.contracts import LossInputs, PolicyLoss, TokenCorrection
from astratk.training.regularizers import kl_to_reference


def check_corrections(corrections: Sequence[TokenCorrection] | None) -> tuple[list[TokenCorrection], list[str]]:
    """The corrections as a list and their metric names (`name`, then `name_2`, ... for repeats)."""
    corrections = list(corrections or [])
    names: list[str] = []
    for i, c in enumerate(corrections):
        if not isinstance(c, TokenCorrection):
            raise TypeError(f"corrections[{i}]: expected an astratk.losses.corrections.TokenCorrection (e.g. TIS(cap=2.0) "
                            f"or MIS(low=0.5, high=2.0)), got {type(c).__name__}")
        base, n = c.name, 2
        name = base
        while name in names:
            name, n = f"{base}_{n}", n + 1
        names.append(name)
    return corrections, names


def apply_corrections(corrections: Sequence[TokenCorrection], names: Sequence[str],
                      inputs: LossInputs) -> tuple[LossInputs, dict[str, torch.Tensor]]:
    """Apply each correction in order; each sees the weights and mask the previous ones left.

    Weights start from `inputs.weights` (ones if None); the mask product keeps the mask's dtype.
    Metrics come back as `correction/<name>/<metric>`.
    """
    metrics: dict[str, torch.Tensor] = {}
    if not corrections:
        return inputs, metrics
    weights = inputs.weights if inputs.weights is not None else torch.ones_like(inputs.loss_mask)
    mask = inputs.loss_mask
    for name, correction in zip(names, corrections, strict=True):
        out = correction(dataclasses.replace(inputs, weights=weights, loss_mask=mask))
        weights = weights * out.weights.detach().to(weights.dtype)  # [B, T]
        mask = mask * out.keep.to(mask.dtype)  # [B, T]
        metrics.update({f"correction/{name}/{k}": v for k, v in out.metrics.items()})
    return dataclasses.replace(inputs, weights=weights, loss_mask=mask), metrics


def topk_fields(batch: object, loss: PolicyLoss) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(topk_ids [B, T, K], topk_behavior_logprobs [B, T, K]) truncated to the loss's K, or (None, None)."""
    k = loss.needs_topk
    if not k:
        return None, None
    ids = getattr(batch, "topk_ids", None)
    mu = getattr(batch, "topk_behavior_logprobs", None)
    if ids is None or mu is None:
        raise ValueError(f"loss {loss!r} needs the engine's top-{k} log-probs (needs_topk={k}) but the batch carries "
                         f"none: the engine must be asked for top-K log-probs (SamplingParams.top_k_logprobs={k}) so "
                         "that trajectories carry behavior_topk_ids / behavior_topk_logprobs")
    if ids.shape[-1] < k:
        raise ValueError(f"loss {loss!r} needs top-{k} log-probs but the batch carries only K={ids.shape[-1]}; ask "
                         f"the engine for SamplingParams.top_k_logprobs={k}")
    return ids[..., :k], mu[..., :k]


def add_regularizers(token_losses: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor, *,
                     ref_logprobs: torch.Tensor | None, kl_coef: float, kl_estimator: str,
                     entropy: torch.Tensor | None, entropy_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """token_losses + kl_coef·KL(π‖π_ref)·m − entropy_coef·H·m, all [B, T], m = the loss's effective mask.

    Under the effective mask so that the extra terms count over exactly the tokens of the aggregation denominator
    (tokens MIS dropped get neither). Correction weights are not applied: these regularise π itself, as verl's
    kl_loss / entropy terms do. Metrics: `kl_ref_mean`, `entropy_mean` (means over the mask), when on.
    """
    metrics: dict[str, torch.Tensor] = {}
    m = mask.to(token_losses.dtype)  # [B, T]
    if ref_logprobs is not None:
        kl = kl_to_reference(logprobs, ref_logprobs, kl_estimator)  # [B, T]
        token_losses = token_losses + kl_coef * kl * m  # kl is finite (log ratio clamped)
        metrics["kl_ref_mean"] = _masked_mean(kl, m)
    if entropy is not None:
        token_losses = token_losses - entropy_coef * entropy * m
        metrics["entropy_mean"] = _masked_mean(entropy, m)
    return token_losses, metrics


def sum_over_ranks(all_gather: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`LossInputs.reduce` from a gather that stacks every rank's tensor on a new dim 0 (`LightningModule.all_gather`).

    The result is detached: batch statistics choose masks and thresholds, they carry no gradient. Every rank must
    pass the same shape (scalars or fixed-size statistics), as with any all-reduce.
    """
    return lambda x: all_gather(x.detach()).sum(0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean over the mask; 0 for an empty mask."""
    return (x.detach() * mask).sum() / mask.sum().clamp_min(1.0)
