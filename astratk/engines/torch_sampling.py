"""Sampling and stopping for `TorchEngine`: each row's next token, its behaviour log-prob, and whether it ends the row.

Sampling is inverse-CDF on softmax(logits / T), no top-k / top-p (so r = 1 on-policy); T = 0 is greedy, scored with
the untempered softmax. Random numbers are a counter-based hash of (row seed, token index), so a seeded request gets
the same completion whatever shares its batch. Stop strings are checked on a short decoded tail of each row's tokens
(`_TextStops`). A new sampling rule must keep the log-prob that of the distribution actually sampled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from astratk.contracts import GenerationRequest


def _signed64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_M1, _M2, _GOLDEN = _signed64(0xBF58476D1CE4E5B9), _signed64(0x94D049BB133111EB), 0x9E3779B97F4A7C15


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negatives)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 products wrap modulo 2**64 as the algorithm needs."""
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def _uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """[B] float32 uniforms in (0, 1) for token `step` of rows seeded [B] int64. 22 bits, so that u * total < total
    holds in fp32 (see `_sample`); probabilities are resolved to 2.4e-7."""
    h = _mix64(_mix64(seeds) + _signed64((step + 1) * _GOLDEN))
    return (_lsr(h, 42).float() + 0.5) * (1.0 / (1 << 22))


_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF (`_sample`)


def _sample(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, step: int):
    """Next tokens [B] and their behaviour log-probs [B] from logits [B, V] at per-row temperatures [B].

    Inverse CDF in two levels: the vocabulary in blocks of 256, the block whose cumulative mass passes the row's
    uniform draw, then the token inside it. Why: one cumsum over [B, V] is sequential in V and took most of sampling's
    time with real vocabularies (49k tokens: 29 ms of a decode step at batch 64, measured; 16 ms this way). The
    log-prob is the softmax's, log p = z - max - log sum exp(z - max) with z = logits / T, from the same exponentials
    (`logprobs_from_logits`, the trainer's formula, agrees to ~1e-6)."""
    logits = logits.float()
    greedy = temps == 0
    t = torch.where(greedy, torch.ones_like(temps), temps)
    z = logits if bool((t == 1).all()) else logits / t.unsqueeze(1)  # [B, V]
    peak = z.amax(-1, keepdim=True)  # [B, 1]
    b, v = z.shape
    e = z.new_zeros(b, v + (-v) % _CDF_BLOCK)
    torch.sub(z, peak, out=e[:, :v]).exp_()  # unnormalised probabilities; the padding stays 0
    blocks = e.view(b, -1, _CDF_BLOCK)  # [B, NB, 256]
    mass = blocks.sum(-1)  # [B, NB]
    cdf = mass.cumsum(-1)  # [B, NB]
    total = cdf[:, -1:]  # [B, 1]
    target = _uniform(seeds, step).unsqueeze(1) * total  # [B, 1]; u < 1, so target < total
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [B, 1]: its mass is > 0
    inner = blocks[torch.arange(b, device=z.device), block.squeeze(1)].cumsum(-1)  # [B, 256]
    # the draw's place inside the block, kept inside its mass (the two sums round differently)
    rest = torch.minimum((target - (cdf.gather(1, block) - mass.gather(1, block))).clamp_(min=0.0),
                         inner[:, -1:] * (1.0 - 2.0 ** -23))
    token = (block * _CDF_BLOCK + torch.searchsorted(inner, rest, right=True).clamp_(max=_CDF_BLOCK - 1)).squeeze(1)
    if bool(greedy.any()):
        token = torch.where(greedy, logits.argmax(-1), token)
    logprob = z.gather(1, token.unsqueeze(1)) - peak - total.log()  # [B, 1]
    return token, logprob.squeeze(1)


def _topk_logprobs(logits: torch.Tensor, temps: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K log-probs [B, K] and ids [B, K] of the distribution sampled (temperature applied; untempered for T=0)."""
    t = torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(1)
    return torch.log_softmax(logits.float() / t, dim=-1).topk(k, dim=-1)


def _row_seeds(requests: list[GenerationRequest], generator: torch.Generator) -> torch.Tensor:
    """[B] int64: the request's seed, or one drawn from `generator` (the engine's, seeded by its `seed=`)."""
    drawn = torch.randint(0, 1 << 62, (len(requests),), generator=generator)
    given = [r.params.seed for r in requests]
    return torch.tensor([_signed64(s) if s is not None else int(d) for s, d in zip(given, drawn, strict=True)])


@dataclass
class _TextStops:
    """One row's stop strings and the tokens it has generated so far (its prompt is never searched)."""

    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    window: int = field(init=False)  # tokens before the newest one that a check decodes

    def __post_init__(self) -> None:
        # Enough to hold the longest stop string even when each of its characters takes several tokens (UTF-8
        # bytes), with a few spare so a character cut at the tail's start cannot reach it.
        self.window = 4 * max(map(len, self.stops)) + 4

    def completed(self, before: str, after: str) -> bool:
        """Whether a stop string ends inside the text the newest token added: `before` and `after` decode the same
        tail without and with it. Earlier characters may change too (a multi-byte character completed), so the new
        text starts where the two stop agreeing; an occurrence wholly before it stopped the row already."""
        start = len(os.path.commonprefix([before, after]))
        return any(after.find(s, max(0, start - len(s) + 1)) >= 0 for s in self.stops)


def _text_stop_hits(tokenizer: Any, states: dict[int, _TextStops], rows: torch.Tensor, tok: torch.Tensor,
                    check: torch.Tensor) -> torch.Tensor:
    """[B] bool: which rows flagged in `check` [B] complete a stop string with their newest token `tok` [B]. `rows`
    [B] maps batch positions to `states` keys (they move when the batch is compacted)."""
    hits = torch.zeros_like(check)
    sel = check.nonzero().squeeze(1)
    if not len(sel):
        return hits
    batch, tails = [states[i] for i in rows[sel].tolist()], []
    for state, t in zip(batch, tok[sel].tolist(), strict=True):
        state.tokens.append(t)
        tail = state.tokens[-state.window - 1:]
        tails += [tail[:-1], tail]
    texts = tokenizer.batch_decode(tails, skip_special_tokens=False)
    found = [state.completed(before, after)
             for state, before, after in zip(batch, texts[::2], texts[1::2], strict=True)]
    hits[sel] = torch.tensor(found, device=hits.device)
    return hits

