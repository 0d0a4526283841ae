"""The one place where per-token losses become the scalar to minimise.

A loss returns per-token losses `[B, T]` already multiplied by its effective mask, and that mask; the trainer calls
`aggregate` once. Modes (n_i = tokens of sequence i in the mask, N = number of sequences, H = `horizon`):

| mode | value | used by |
|---|---|---|
| `token-mean` | sum_it l / sum_it m | DAPO |
| `seq-mean-token-mean` | (1/N) sum_i (sum_t l_it / n_i) | original GRPO, GSPO |
| `seq-mean-token-sum` | (1/N) sum_i sum_t l_it | |
| `seq-mean-token-sum-norm` | (1/N) sum_i (sum_t l_it / H), H = max completion length | Dr.GRPO, DPPO/DRPO recipes |
| `token-sum` | sum_it l (no normaliser) | Tinker-style sum losses |

`token-sum` makes the update's size grow with the batch's token count: scale the learning rate with the batch (a
step of N tokens is N times one token's gradient). Under DDP each rank's sum is its numerator and the caller's
world-size factor turns DDP's average back into the global sum.

Empty sequences (n_i = 0: every token masked, e.g. by MIS) are COUNTED in N and contribute 0; implementations differ by
exactly this factor (verl excludes them, TRL and UniRL count them) and astratk counts them. In
`seq-mean-token-mean` such a sequence's own mean is 0, not 0/0. An all-zero mask gives 0, never NaN.

Distributed data parallel: by default the denominators are this process's own counts. Under DDP pass the all-reduced
counts (`global_tokens` = total mask sum over ranks for `token-mean`, `global_seqs` = total sequences over ranks for the
`seq-*` modes); the result is then this rank's share of the global mean, and since DDP *averages* gradients over ranks
the caller multiplies it by the world size before `backward`, so the averaged gradient equals the global mean's.
To add a mode: a name in `AGGREGATIONS` (`astratk.spec.trainer`), a branch in `aggregate`, a hand-computed test in tests/unit.
"""

from __future__ import annotations

import torch

from astratk.registry import check_choice
from astratk.spec.trainer import AGGREGATIONS  # the names a config may give

Count = int | float | torch.Tensor


def check_aggregation(mode: str, horizon: int | None = None) -> None:
    """Validate a mode (and its horizon) at construction time, with the choices in the error."""
    check_choice("aggregation", mode, AGGREGATIONS)
    if mode == "seq-mean-token-sum-norm" and (horizon is None or not horizon > 0):
        raise ValueError(f"aggregation 'seq-mean-token-sum-norm' needs horizon = the maximum completion length H "
                         f"(Dr.GRPO's constant normaliser, > 0); got horizon={horizon}. Set it to sampling max_tokens")


def _denominator(global_count: Count | None, local_count: Count, like: torch.Tensor) -> torch.Tensor:
    """A count as a scalar tensor, at least 1: an empty batch then yields 0 / 1 = 0 instead of NaN."""
    count = local_count if global_count is None else global_count
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1.0)


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, mode: str, horizon: int | None = None,
              global_tokens: Count | None = None, global_seqs: Count | None = None) -> torch.Tensor:
    """Reduce masked per-token losses `[B, T]` to a scalar according to `mode` (see the module docstring).

    `token_losses` must already be multiplied by `mask` (the `LossOutputs` contract); it is not re-masked here, so a
    loss's soft per-token weights are kept as given.

    Example:
        >>> import torch
        >>> losses, mask = torch.tensor([[1.0, 2.0], [4.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
        >>> round(aggregate(losses, mask, "token-mean").item(), 4)  # (1 + 2 + 4) / 3
        2.3333
        >>> aggregate(losses, mask, "seq-mean-token-mean").item()  # (3 / 2 + 4 / 1) / 2
        2.75
    """
    check_aggregation(mode, horizon)
    if token_losses.shape != mask.shape or token_losses.dim() != 2:
        raise ValueError(f"token_losses and mask must both be [B, T]; got {tuple(token_losses.shape)} and "
                         f"{tuple(mask.shape)}")
    mask = mask.to(token_losses.dtype)  # [B, T]
    if mode == "token-sum":
        return token_losses.sum()
    if mode == "token-mean":
        return token_losses.sum() / _denominator(global_tokens, mask.sum(), token_losses)
    seq_sums = token_losses.sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        seq_values = seq_sums / mask.sum(dim=-1).clamp_min(1.0)  # [B] an empty sequence gives 0 / 1 = 0
    elif mode == "seq-mean-token-sum":
        seq_values = seq_sums  # [B]
    else:  # seq-mean-token-sum-norm
        seq_values = seq_sums / float(horizon)  # [B]
    return seq_values.sum() / _denominator(global_seqs, token_losses.shape[0], token_losses)
