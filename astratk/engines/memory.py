"""`MemoryBudget`: what a `TorchEngine` on a GPU may hold (`gpu_memory_utilization`, vLLM's name and meaning: a
fraction of the device's total memory for this engine), and how many rows of a batch fit in it.

A batch of B rows, prompts left-padded to P tokens and N new tokens, holds on the device:
- the KV cache, allocated up front for the whole batch: B x (P + N) x `kv_bytes_per_token` (K and V of every layer);
- the prefill's activations, the largest transient: B x P x `act_bytes_per_token` (residual, normed input,
  q/k/v/o and the MLP's gate, up and product, in the engine's dtype), plus the [B, 1, P, P + N] attention mask;
- sampling's temporaries per row: the [V] logits in fp32 and the softmax, CDF and log-prob tensors made from them.
The weights are resident. The engine takes rows for a batch while weights + that sum stay under the budget less
`MARGIN` (allocator fragmentation), so its batches shrink with longer prompts or budgets instead of running out of
memory; `stats["budget_capped_batches"]` counts the batches cut short. These are estimates from the model config:
the GPU tests (tests/gpu/) check that a batch the budget admits runs under the cap the engine sets on its process.

Example:
    >>> b = MemoryBudget("cuda:0", 0.5, total_bytes=8 << 30, weight_bytes=1 << 30, kv_bytes_per_token=1 << 15,
    ...                  act_bytes_per_token=1 << 14, logit_bytes_per_row=1 << 20)
    >>> b.rows(64, 64) > b.rows(512, 512) > 0
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MARGIN = 0.1  # of the budget, kept free for the caching allocator's fragmentation
GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryBudget:
    device: str  # "cuda:N"
    fraction: float  # of the device's total memory (gpu_memory_utilization)
    total_bytes: int  # the device's memory
    weight_bytes: int  # the model's parameters and buffers on the device
    kv_bytes_per_token: int  # K and V of every layer for one token of one row
    act_bytes_per_token: int  # the prefill's peak activations per prompt token
    logit_bytes_per_row: int  # sampling's fp32 temporaries over the vocabulary, per row

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * self.total_bytes)

    @property
    def free_bytes(self) -> int:
        """What the budget leaves for batches: budget less the margin, less the weights (may be negative)."""
        return int(self.budget_bytes * (1 - MARGIN)) - self.weight_bytes

    def row_bytes(self, prompt_width: int, new_tokens: int) -> int:
        """Device bytes one row of a batch needs: its KV cache, prefill activations, mask and sampling buffers."""
        span = prompt_width + new_tokens
        return (span * self.kv_bytes_per_token + prompt_width * self.act_bytes_per_token + prompt_width * span
                + self.logit_bytes_per_row)

    def rows(self, prompt_width: int, new_tokens: int) -> int:
        """How many rows of prompts padded to `prompt_width` and `new_tokens` new tokens fit (0: not even one)."""
        return max(0, self.free_bytes // self.row_bytes(prompt_width, new_tokens))

    def describe(self, max_batch: int) -> str:
        """One line: the budget, the weights, what is left, and what it admits at a representative length."""
        rows = self.rows(512, 512)
        return (f"TorchEngine on {self.device}: gpu_memory_utilization {self.fraction:.2f} of "
                f"{self.total_bytes / GIB:.1f} GiB = {self.budget_bytes / GIB:.2f} GiB, weights "
                f"{self.weight_bytes / GIB:.2f} GiB, {self.free_bytes / GIB:.2f} GiB left for the KV cache "
                f"({self.kv_bytes_per_token / 1024:.0f} KiB per token) and activations: {rows} rows of 512 + 512 "
                f"tokens fit in a batch (max_batch {max_batch}); longer rows, fewer")


def model_budget(model: Any, device: str, fraction: float) -> MemoryBudget:
    """The budget of `model` (already on `device`, in its serving dtype) at `fraction` of the device's memory, from
    the model's config; a config without the fields fails naming them."""
    import torch

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers, hidden = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "num_attention_heads", None)
    vocab = getattr(cfg, "vocab_size", None)
    if None in (layers, hidden, heads, vocab):
        raise ValueError(f"rollout.engine_args.gpu_memory_utilization: the model's config ({type(cfg).__name__}) "
                         "lacks num_hidden_layers, hidden_size, num_attention_heads or vocab_size, from which the "
                         "engine sizes its batches; remove the budget for this model")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    intermediate = getattr(cfg, "intermediate_size", None) or 4 * hidden
    size = next(model.parameters()).element_size()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    index = torch.device(device).index or 0
    return MemoryBudget(device=device, fraction=fraction,
                        total_bytes=torch.cuda.get_device_properties(index).total_memory,
                        weight_bytes=weights, kv_bytes_per_token=2 * layers * kv_heads * head_dim * size,
                        act_bytes_per_token=(6 * hidden + 3 * intermediate) * size,
                        logit_bytes_per_row=8 * 4 * vocab)
