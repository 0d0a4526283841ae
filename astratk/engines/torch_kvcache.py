"""The model side of `TorchEngine`'s decoding: a KV cache allocated up front, and grouped-K/V attention on the CPU.

`new_cache` gives a batch a `DynamicCache` whose layers hold its whole capacity from the first write (`_GrowingLayer`);
`_GQA_ATTENTION` names the attention the engine sets on CPU models with sdpa attention (`_sdpa_gqa`). Both give the
outputs HF's own classes give; a new speed-up belongs here if it keeps that so (tests/unit/test_torch_engine.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

_GQA_ATTENTION = "astratk_sdpa_gqa"


def _sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention, except that masked single-token decode steps keep K/V grouped, and bf16/fp16 decode steps
    run as matmuls (`_decode_attention`).

    Why: with a padding mask, transformers 5.19 repeats K/V once per query head on CPU (`repeat_kv` copies the whole
    cache in every layer at every step); torch's sdpa handles grouped heads itself (`enable_gqa`) with the same result
    (max difference 0 measured) at ~4x less time per call at batch 512. Everything else goes to HF's function.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] == 1 and not module.training and query.dtype in (torch.bfloat16, torch.float16):
        return _decode_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    if attention_mask is None or query.shape[2] != 1 or groups == 1 or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"),
                                         enable_gqa=True)  # [B, H, 1, D]
    return out.transpose(1, 2).contiguous(), None


def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None) -> torch.Tensor:
    """One decode step's attention in bf16/fp16 as two batched matmuls, scores and softmax in fp32; returns
    [B, 1, H, D]. Why: torch's CPU flash attention takes ~11x longer in bf16 than these matmuls (which run on the
    CPU's bf16 units) for a step of 32 rows over 450 positions (measured: 15.3 ms against 1.3 ms per layer), and
    the whole bf16 decode step was 2x slower than fp32 because of it."""
    b, h, _, d = query.shape
    kv = key.shape[1]
    # K times the queries, not the queries times K transposed: K is a view of the cache's storage, and a transposed
    # view made the matmul copy the whole cache in every layer at every step
    scores = torch.matmul(key, query.view(b, kv, h // kv, d).transpose(-1, -2)).transpose(-1, -2).float()  # [B,KV,G,L]
    scores = scores * (d ** -0.5 if scale is None else scale)
    if mask is None:  # no padding: one query attends to every position
        pass
    elif mask.dtype == torch.bool:  # [B, 1, 1, L], True where a row may attend
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).view(b, h, 1, d).transpose(1, 2).contiguous()


AttentionInterface.register(_GQA_ATTENTION, _sdpa_gqa)
AttentionMaskInterface.register(_GQA_ATTENTION, sdpa_mask)


class _GrowingLayer(DynamicLayer):
    """A `DynamicLayer` with its capacity allocated up front, so a step writes its K/V in place. Why: `DynamicLayer`
    `torch.cat`s the whole cache at every step (most of decode time at batch 512, measured); a batch knows its longest
    prompt and largest budget, so the capacity is exact. Keys/values are views [B, H, n, D]."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty(b, h, self.capacity, d)
        self._v = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity} (engine bug)")
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def preload(self, pieces: list[tuple[torch.Tensor, torch.Tensor] | None], width: int) -> None:
        """Fill positions [0, `width`) of every row: row i's K/V [H, m_i, D] from `pieces` (a prefix cache's),
        right-aligned at `width`; zeros where a row has none (its attention mask hides them)."""
        k0, v0 = next(p for p in pieces if p is not None)
        self.dtype, self.device = k0.dtype, k0.device
        self._k = k0.new_zeros(len(pieces), k0.shape[0], self.capacity, k0.shape[-1])
        self._v = v0.new_zeros(len(pieces), v0.shape[0], self.capacity, v0.shape[-1])
        for i, piece in enumerate(pieces):
            if piece is not None:
                m = piece[0].shape[1]
                self._k[i, :, width - m:width], self._v[i, :, width - m:width] = piece
        self.length, self.is_initialized = width, True
        self.keys, self.values = self._k[:, :, :width], self._v[:, :, :width]

    def row(self, i: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's K/V [H, len(positions), D] at `positions`, copied out."""
        return self._k[i][:, positions].clone(), self._v[i][:, positions].clone()

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]



def new_cache(model: torch.nn.Module, capacity: int) -> DynamicCache:
    """A KV cache for `model` holding `capacity` positions per row, HF's layer kinds other than `DynamicLayer` kept."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if not cache.layers and cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = lambda: _GrowingLayer(capacity)
    return cache
