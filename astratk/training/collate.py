"""Collate the groups the data layer serves into a padded `TrainBatch` (trainer-side).

Alignment: position t of every [B, T] tensor describes the prediction of token t + 1, so completion token j of a
trajectory (absolute index n_prompt + j) sits at position n_prompt + j - 1. Top-K tensors [B, T, K] are built only
when every trajectory carries top-K log-probs (K = the smallest K among them). `weights` is the loss mask times the
group's serving weight (`Group.weight`: lag decay, 1 unless configured).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astratk.records import Group, TrainBatch


def collate(groups: Sequence[Group], pad_id: int) -> TrainBatch:
    rows = [(t, adv, g.weight) for g in groups for t, adv in zip(g.trajectories, _advantages(g), strict=True)]
    if not rows:
        raise ValueError("cannot collate an empty batch: the data layer served no trajectories")
    length = max(len(t.tokens) for t, _, _ in rows)
    b, T = len(rows), length - 1
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    loss_mask = torch.zeros((b, T))
    behavior = torch.zeros((b, T))
    advantages = torch.zeros((b, T))
    weights = torch.zeros((b, T))
    versions = torch.full((b, T), -1, dtype=torch.long)
    rewards = torch.zeros(b)
    k = min((len(next((x for x in t.behavior_topk_ids if x), ())) for t, _, _ in rows), default=0)  # env tokens: ()
    top_ids = torch.zeros((b, T, k), dtype=torch.long) if k else None
    top_lp = torch.zeros((b, T, k)) if k else None
    for i, (traj, adv, weight) in enumerate(rows):
        n, p = len(traj.tokens), traj.n_prompt
        input_ids[i, :n] = torch.tensor(traj.tokens, dtype=torch.long)
        attention_mask[i, :n] = 1
        span = slice(p - 1, n - 1)  # positions predicting the completion tokens
        mask = torch.tensor(traj.loss_mask, dtype=torch.float32)
        loss_mask[i, span] = mask
        behavior[i, span] = torch.tensor(traj.behavior_logprobs, dtype=torch.float32)
        advantages[i, span] = adv * mask
        weights[i, span] = mask * weight  # the group's serving weight (lag decay), 1 by default
        versions[i, span] = torch.tensor(traj.behavior_versions, dtype=torch.long)
        rewards[i] = float(traj.reward if traj.reward is not None else 0.0)
        if k:  # env tokens carry empty tuples: they stay 0 (and loss_mask 0)
            for j, (ids, lps) in enumerate(zip(traj.behavior_topk_ids, traj.behavior_topk_logprobs, strict=True)):
                if ids:
                    top_ids[i, p - 1 + j] = torch.tensor(ids[:k])
                    top_lp[i, p - 1 + j] = torch.tensor(lps[:k])
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      behavior_logprobs=behavior, advantages=advantages, weights=weights, versions=versions,
                      n_groups=len(groups), rewards=rewards, topk_ids=top_ids, topk_behavior_logprobs=top_lp,
                      roles=tuple(t.role for t, _, _ in rows))


def _advantages(group: Group) -> Sequence[float]:
    if group.advantages is None:
        raise ValueError(f"group {group.group_id} reached the trainer without advantages; groups must pass through "
                         "DataLayer.admit")
    return group.advantages


# ----------------------------------------------------------------------------------------------- micro-batches
# One optimiser step's batch, cut into micro-batches that the trainer runs one after another (gradient accumulation,
# `PolicyModule(micro_batch_tokens=...)`): the forward's activation memory then scales with the budget, not the batch.


def row_lengths(batch: TrainBatch) -> torch.Tensor:
    """[B] int64: each row's length up to its last real token (right padding: its number of tokens)."""
    am = batch.attention_mask  # [B, L]
    positions = torch.arange(1, am.shape[1] + 1, device=am.device)  # [L]
    return ((am != 0).long() * positions).amax(dim=1)


def micro_batches(batch: TrainBatch, max_tokens: int | None) -> list[torch.Tensor]:
    """Row indices [b_m] of each micro-batch; together they cover every row exactly once.

    A micro-batch's cost is its padded token count: rows x the longest row in it (`select_rows` trims the columns
    to that). Each stays within `max_tokens`, except a single row longer than the budget, which is a micro-batch by
    itself. Rows are packed longest first, so the first row of a micro-batch sets its width and short rows share
    micro-batches with short rows (little padding); ties keep row order, so the plan is deterministic. `max_tokens`
    None, or a batch whose whole padded size fits, gives one micro-batch of all rows in order.

    Example:
        >>> import torch
        >>> am = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
        >>> b = TrainBatch(am, am, *(torch.zeros(4, 3) for _ in range(4)), torch.zeros(4, 3, dtype=torch.long))
        >>> [r.tolist() for r in micro_batches(b, 6)]  # lengths 4, 2, 3, 2: [4] then 2 x 3, then 2 x 2
        [[0], [1, 2], [3]]
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (padded tokens per micro-batch) or None, got {max_tokens}")
    n = len(batch)
    lengths = row_lengths(batch).tolist()
    if max_tokens is None or n * max(lengths, default=0) <= max_tokens:
        return [torch.arange(n)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * max(lengths[chunks[-1][0]], 1) <= max_tokens:
            chunks[-1].append(i)  # lengths descend: the chunk's first row is its widest
        else:
            chunks.append([i])
    return [torch.tensor(sorted(rows)) for rows in chunks]


def select_rows(batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
    """The rows `rows` [b] of `batch`, trimmed to their longest row: input columns [:L_m], token columns [:L_m - 1].

    Trimming drops only columns that are padding in every selected row (right padding; a left-padded batch keeps
    its full width), and position t keeps its meaning (it predicts token t + 1). `n_groups` stays the batch's.
    """
    width = max(int(row_lengths(batch)[rows].max()), min(2, batch.input_ids.shape[1]))  # >= 1 token position
    t = width - 1

    def take(x: torch.Tensor | None, cols: int) -> torch.Tensor | None:
        return None if x is None else x[rows, :cols]

    return TrainBatch(input_ids=take(batch.input_ids, width), attention_mask=take(batch.attention_mask, width),
                      loss_mask=take(batch.loss_mask, t), behavior_logprobs=take(batch.behavior_logprobs, t),
                      advantages=take(batch.advantages, t), weights=take(batch.weights, t),
                      versions=take(batch.versions, t), n_groups=batch.n_groups,
                      rewards=None if batch.rewards is None else batch.rewards[rows],
                      topk_ids=take(batch.topk_ids, t), topk_behavior_logprobs=take(batch.topk_behavior_logprobs, t),
                      roles=tuple(batch.roles[i] for i in rows.tolist()) if batch.roles else ())


def place_rows(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], n_rows: int, width: int) -> torch.Tensor:
    """The inverse of `select_rows` for per-token results: (rows [b_m], values [b_m, t_m, ...]) pieces placed into
    one zero-filled [n_rows, width, ...] tensor (columns past a piece's t_m stay 0: they are its padding)."""
    first = parts[0][1]
    out = first.new_zeros((n_rows, width, *first.shape[2:]))
    for rows, values in parts:
        out[rows, : values.shape[1]] = values
    return out
