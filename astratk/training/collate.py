"""Collate the groups the data layer serves into a padded `TrainBatch` (trainer-side; DESIGN §2).

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
    rows = [(t, adv, g.weight) for g in groups for t, adv in zip(g.trajectories, _advantages(g))]
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
            for j, (ids, lps) in enumerate(zip(traj.behavior_topk_ids, traj.behavior_topk_logprobs)):
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
