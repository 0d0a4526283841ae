"""`logprobs_from_logits`: the one log-prob formula the engines and the trainer share.

μ is the distribution the engine actually sampled, so log π must come from logits / T with the
rollout's T (T = 0, greedy, is scored with the untempered softmax). `TorchEngine` calls `logprobs_from_logits` on
each decode step's logits and the trainer's recomputation (`astratk.training.logprobs.token_logprobs`) on the whole
sequence's, so on the same weights both sides run the same arithmetic and agree to fp32 rounding
(tests/unit/test_torch_engine.py checks 1e-5). It lives here, beside the models, so engines need not import the
trainer.
"""

from __future__ import annotations

import torch

__all__ = ["logprobs_from_logits"]


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor,
                         temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[targets], in fp32.

    logits: [..., V]; targets: [...] int64; temperature: a float, or a tensor broadcastable to `targets` ([B] for
    the engine's [B] targets, [B, 1] for per-row temperatures over [B, T] targets). Temperatures of 0 (greedy) count
    as 1.

    Why logsumexp minus the gathered logit rather than `log_softmax(...).gather(...)`: it never materialises a second
    [..., V] tensor of log-probs, and autograd keeps only the (scaled) logits for the backward pass.

    Example:
        >>> logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
        >>> logprobs_from_logits(logits, torch.tensor([0])).exp().tolist()  # softmax(log p) = p
        [0.5]
    """
    logits = logits.float()  # [..., V]
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits)
        logits = logits / t.unsqueeze(-1)
    elif temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(logits, dim=-1)
