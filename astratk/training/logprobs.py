"""Per-token log-probs: the trainer's recomputation of log π, with the formula the engines use.

Log π must come from logits / T with the rollout's T, as the engine sampled. Both sides call
`astratk.models.logprobs.logprobs_from_logits` (the engine per decode step, `token_logprobs` here per sequence), so
on the same weights they run the same arithmetic and agree to fp32 rounding (tests/unit/test_torch_engine.py checks
1e-5).

Alignment (`TrainBatch`): position t predicts `input_ids[:, t + 1]`, so the result is [B, L - 1].

`policy_forward` is the trainer's one grad forward when it needs more than log π: the entropy of π (entropy bonus)
and log π at the engine's top-K ids (DPPO's Top-K divergences), all from the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astratk.models.logprobs import logprobs_from_logits
from astratk.training.prefix import PrefixPlan, gather_positions, stitch, two_pass_logits


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, prefixes: PrefixPlan | None = None) -> torch.Tensor:
    """log π(input_ids[:, t + 1] | input_ids[:, : t + 1]) at temperature T, for every t: [B, L - 1] float32.

    input_ids, attention_mask: [B, L], right-padded (`TrainBatch`); left padding works too, because position ids
    are counted from the mask (0..n-1 over each row's real tokens), as the engine does when it samples.
    Entries whose target is padding are 0. Gradients flow to the model unless the caller disables them.
    `prefixes` (right padding only): run each shared prompt once (`astratk.training.prefix`); same values.

    Example:
        >>> lp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0)  # doctest: +SKIP
        >>> # lp: [B, T], aligned with batch.loss_mask and batch.behavior_logprobs
    """
    if prefixes is not None:
        return policy_forward(model, input_ids, attention_mask, temperature, prefixes=prefixes).logprobs
    logits = _next_token_logits(model, input_ids, attention_mask)  # [B, L-1, V]
    lp = logprobs_from_logits(logits, input_ids[:, 1:], temperature)  # [B, L-1]
    return lp.masked_fill(attention_mask[:, 1:] == 0, 0.0)


@dataclass
class PolicyForward:
    logprobs: torch.Tensor  # [B, T] log pi of the next tokens, as `token_logprobs` (0 where the target is padding)
    entropy: torch.Tensor | None = None  # [B, T] entropy of pi(. | s_t) at temperature T (0 at padding)
    topk_logprobs: torch.Tensor | None = None  # [B, T, K] log pi at the given top-K ids (0 at padding)


def policy_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, *, entropy: bool = False,
                   topk_ids: torch.Tensor | None = None, prefixes: PrefixPlan | None = None) -> PolicyForward:
    """`token_logprobs` plus, from the same logits, the entropy and/or log π at `topk_ids` [B, T, K] (int64).

    log π at the sampled and at the top-K ids share one logsumexp of logits / T, so both are the same arithmetic as
    `logprobs_from_logits` (identical values). Gradients flow unless the caller disables them. With `prefixes`
    (`astratk.training.prefix.plan`), each shared prompt runs once and the outputs are stitched back into this
    layout: the same values to float rounding.

    Example:
        >>> fwd = policy_forward(model, batch.input_ids, batch.attention_mask, 1.0, entropy=True)  # doctest: +SKIP
        >>> fwd.logprobs.shape == fwd.entropy.shape == batch.loss_mask.shape  # doctest: +SKIP
        True
    """
    pad = attention_mask[:, 1:] == 0  # [B, T]
    if prefixes is None:
        logits = _next_token_logits(model, input_ids, attention_mask)  # [B, T, V]
        fwd = _from_logits(logits, input_ids[:, 1:], temperature, entropy, topk_ids)
    else:
        pre_logits, pre_ids, suf_logits, suf_ids = two_pass_logits(model, input_ids, prefixes)
        s = suf_ids.shape[1] - 1
        pre_topk, suf_topk = (None, None) if topk_ids is None else gather_positions(topk_ids, prefixes, s)
        pre = _from_logits(pre_logits, pre_ids[:, 1:], temperature, entropy, pre_topk)
        suf = _from_logits(suf_logits[:, :s], suf_ids[:, 1:], temperature, entropy, suf_topk)
        width = pad.shape[1]
        fwd = PolicyForward(*(None if a is None else stitch(prefixes, a, b, width)
                              for a, b in ((pre.logprobs, suf.logprobs), (pre.entropy, suf.entropy),
                                           (pre.topk_logprobs, suf.topk_logprobs))))
    return PolicyForward(logprobs=fwd.logprobs.masked_fill(pad, 0.0),
                         entropy=None if fwd.entropy is None else fwd.entropy.masked_fill(pad, 0.0),
                         topk_logprobs=None if fwd.topk_logprobs is None
                         else fwd.topk_logprobs.masked_fill(pad.unsqueeze(-1), 0.0))


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool,
                 topk_ids: torch.Tensor | None) -> PolicyForward:
    """log π at `targets` [N, T], and optionally the entropy and log π at `topk_ids` [N, T, K], from logits [N, T, V]
    (padding not masked)."""
    from astratk.training.regularizers import entropy_from_logits

    if topk_ids is None:
        lp = logprobs_from_logits(logits, targets, temperature)  # [N, T]
        topk = None
    else:
        z = logits.float()
        if temperature > 0 and temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)  # [N, T]
        lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [N, T]
        topk = z.gather(-1, topk_ids) - lse.unsqueeze(-1)  # [N, T, K]
    ent = entropy_from_logits(logits, temperature) if entropy else None
    return PolicyForward(logprobs=lp, entropy=ent, topk_logprobs=topk)


def _next_token_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The model's logits at positions 0..L-2 (each predicts the next token): [B, L - 1, V]."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=False).logits[:, :-1]
