"""Shared-prompt forwards: the G samples of a group share their prompt, so the trainer runs each prompt once.

A GRPO-style step trains on groups of samples of one prompt. A padded forward computes every row's prompt again: for
the quickstart (16 prompts x 8 samples, a ~24-token ChatML prompt, <= 8 answer tokens) about 70% of the tokens a
forward and backward process are prompt copies. Here the step runs in two passes that give the same logits:

1. the prefix pass: each distinct prompt once ([P, Lp], right-padded), keeping its key/value cache *with gradients*;
2. the suffix pass: every row's remaining tokens ([B, S]) attending to its prompt's cache entries, selected per row
   (`Cache.batch_select_indices`, an index, so the backward sums each prompt's gradient over its samples).

Exact, not an approximation: a prompt token's hidden states depend only on the tokens before it, so they are the same
in every row of the group; the gradient through them is the sum over the rows, which the index's backward computes.
Log-probs agree with the padded forward to float rounding (checked once per module on the first batch, with a
fallback to the padded forward when a model's cache does not allow it: `PolicyModule`).

What is shared: the tokens before each row's first trained position (its loss mask), i.e. the prompt up to its last
token, which stays in the suffix so that its logit (predicting the first answer token) comes from the suffix pass.
Rows group by those tokens' content, so any batch layout works (micro-batches, multi-turn rows whose first turn is a
common prompt); a row whose prefix nobody shares is its own group. `plan` returns None when sharing would not save
at least `min_saving` of the padded token count, and the caller runs the plain forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astratk.models.kvcache import cache_kwargs, returned_cache


@dataclass(frozen=True)
class PrefixPlan:
    owner: torch.Tensor  # [B] int64: the prefix group of each row
    split: torch.Tensor  # [B] int64: k, tokens 0..k-1 come from the prefix pass, k..n-1 from the suffix pass
    lengths: torch.Tensor  # [B] int64: n, each row's real tokens (right padding)
    first_row: torch.Tensor  # [P] int64: one row of each group (its prefix tokens are the group's)
    saving: float  # 1 - padded tokens of the two passes / padded tokens of the plain forward


def plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
         min_saving: float = 0.2) -> PrefixPlan | None:
    """Which rows share which prefix; None when the two passes would not save `min_saving` of the forward's tokens.

    input_ids, attention_mask: [B, L] right-padded; loss_mask: [B, L - 1] (position t trains token t + 1)."""
    b, width = input_ids.shape
    if b < 2 or width < 3:
        return None
    lengths = attention_mask.long().sum(dim=1)  # [B]
    if not torch.equal(attention_mask != 0, torch.arange(width, device=lengths.device) < lengths.unsqueeze(1)):
        return None  # not right padding (left padding, holes): the plain forward handles it
    trained = loss_mask > 0
    first = torch.where(trained.any(dim=1), trained.float().argmax(dim=1), lengths - 1)  # first trained position
    # k = the first trained position: tokens 0..k-1 are shared; token k (the prompt's last) starts the suffix
    split = torch.minimum(first, lengths - 1).clamp(min=1)  # >= 1 token in each pass: no all-padding row
    ids, ks = input_ids.tolist(), split.tolist()
    groups: dict[tuple[int, ...], int] = {}
    owner, first_row = [], []
    for i in range(b):
        key = tuple(ids[i][: ks[i] + 1])  # + the suffix's first token, which the prefix pass's last logit predicts
        g = groups.setdefault(key, len(groups))
        if g == len(first_row):
            first_row.append(i)
        owner.append(g)
    n_groups = len(groups)
    prefix_width = max(ks)
    suffix_width = int((lengths - split).max())
    if suffix_width < 2:  # no trained token after any prefix
        return None
    cost = n_groups * prefix_width + b * suffix_width
    saving = 1.0 - cost / (b * width)
    if n_groups == b or saving < min_saving:
        return None
    dev = input_ids.device
    return PrefixPlan(owner=torch.tensor(owner, device=dev), split=split, lengths=lengths,
                      first_row=torch.tensor(first_row, device=dev), saving=saving)


def two_pass_logits(model: torch.nn.Module, input_ids: torch.Tensor, plan: PrefixPlan
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prefix logits [P, Kmax, V], prefix token ids [P, Kmax + 1], suffix logits [B, S, V], suffix ids [B, S]).

    Prefix position j predicts prefix token j + 1 (the last real one, j = k - 1, predicts the row's token k); suffix
    position j predicts suffix token j + 1, i.e. row position k + j predicts row token k + j + 1."""
    dev = input_ids.device
    k_rows, n_rows = plan.split, plan.lengths
    k_pre = k_rows[plan.first_row]  # [P]
    width = int(k_pre.max())
    cols = torch.arange(width + 1, device=dev)
    pre_ids = input_ids[plan.first_row][:, : width + 1]  # [P, Kmax + 1]: + each prefix's next token (a target)
    pre_mask = (cols[:width].unsqueeze(0) < k_pre.unsqueeze(1)).long()  # [P, Kmax]
    pre_pos = cols[:width].unsqueeze(0).expand(len(k_pre), width)
    out = model(input_ids=pre_ids[:, :width], attention_mask=pre_mask, position_ids=pre_pos, use_cache=True)
    cache = returned_cache(out)
    cache.batch_select_indices(plan.owner)  # [P, ...] -> [B, ...], differentiable
    s = int((n_rows - k_rows).max())
    j = torch.arange(s, device=dev)
    src = (k_rows.unsqueeze(1) + j).clamp(max=input_ids.shape[1] - 1)  # [B, S]
    suf_mask = (j.unsqueeze(0) < (n_rows - k_rows).unsqueeze(1)).long()  # [B, S]
    suf_ids = input_ids.gather(1, src).masked_fill(suf_mask == 0, 0)
    mask = torch.cat([pre_mask[plan.owner], suf_mask], dim=1)  # [B, Kmax + S]
    suf = model(input_ids=suf_ids, attention_mask=mask, position_ids=src, use_cache=True,
                **cache_kwargs(model, cache))
    return out.logits, pre_ids, suf.logits, suf_ids


def stitch(plan: PrefixPlan, pre: torch.Tensor, suf: torch.Tensor, width: int) -> torch.Tensor:
    """Per-position values of both passes in the plain forward's layout: [B, T(, K)] from prefix values [P, Kmax(, K)]
    and suffix values [B, S - 1(, K)]; row position t < k comes from its prefix, t >= k from suffix position t - k."""
    dev = suf.device
    t = torch.arange(width, device=dev).unsqueeze(0)  # [1, T]
    k = plan.split.unsqueeze(1)  # [B, 1]
    from_pre = pre[plan.owner]  # [B, Kmax(, K)]
    pre_at = from_pre.gather(1, _expand(t.clamp(max=pre.shape[1] - 1).expand(len(k), width), from_pre))
    suf_at = suf.gather(1, _expand((t - k).clamp(min=0, max=max(suf.shape[1] - 1, 0)), suf))
    use_pre = t < k
    if suf.dim() == 3:
        use_pre = use_pre.unsqueeze(-1)
    return torch.where(use_pre, pre_at, suf_at)


def gather_positions(values: torch.Tensor, plan: PrefixPlan, suffix_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position inputs in the plain layout [B, T, ...] (top-K ids) cut into (prefix [P, Kmax, ...],
    suffix [B, S - 1, ...]) to match `two_pass_logits`' outputs."""
    dev = values.device
    k_pre = plan.split[plan.first_row]
    width = int(k_pre.max())
    pre = values[plan.first_row][:, :width]
    j = torch.arange(suffix_width, device=dev).unsqueeze(0)
    src = (plan.split.unsqueeze(1) + j).clamp(max=values.shape[1] - 1)
    return pre, values.gather(1, _expand(src, values))


def _expand(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [B, T] index broadcast over `like`'s trailing dimensions, for gather along dim 1."""
    if like.dim() == 2:
        return index
    return index.unsqueeze(-1).expand(*index.shape, *like.shape[2:])


def micro_batches(plan: PrefixPlan, max_tokens: int) -> list[torch.Tensor]:
    """Row indices of micro-batches that keep each prompt's rows together, each costing at most `max_tokens` tokens
    of the two passes (its distinct prompts x the longest of them + its rows x the longest suffix), so that every
    micro-batch still runs each of its prompts once. Groups are packed widest first into the open micro-batch while
    it fits; a group that alone exceeds the budget is cut into row slices (its prompt then runs once per slice); a
    slice of one row is always allowed. Together the micro-batches cover every row once, rows in order within each.

    Example:
        >>> import torch
        >>> p = PrefixPlan(owner=torch.tensor([0, 0, 1, 1]), split=torch.tensor([3, 3, 3, 3]),
        ...                lengths=torch.tensor([5, 6, 5, 5]), first_row=torch.tensor([0, 2]), saving=0.0)
        >>> [r.tolist() for r in micro_batches(p, 9)]  # a group costs 3 + 2 x 3 = 9; both together 2 x 3 + 4 x 3
        [[0, 1], [2, 3]]
    """
    owner, split, lengths = plan.owner.tolist(), plan.split.tolist(), plan.lengths.tolist()
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(owner):
        rows_of.setdefault(g, []).append(i)

    def cost(rows: list[int]) -> int:
        prompts = {owner[i] for i in rows}
        return len(prompts) * max(split[i] for i in rows) + len(rows) * max(lengths[i] - split[i] for i in rows)

    order = sorted(rows_of.values(), key=lambda rows: (-max(lengths[i] for i in rows), rows[0]))
    chunks: list[list[int]] = []
    for rows in order:
        if chunks and cost(chunks[-1] + rows) <= max_tokens:
            chunks[-1].extend(rows)
            continue
        piece: list[int] = []
        for i in sorted(rows, key=lambda r: (-lengths[r], r)):
            if piece and cost([*piece, i]) > max_tokens:
                chunks.append(piece)
                piece = []
            piece.append(i)
        chunks.append(piece)
    return [torch.tensor(sorted(rows)) for rows in chunks]
