"""`PrefixCache`: the KV cache of sequences `TorchEngine` has run, kept across batches for prompts that extend them.

An agent's next turn is its last prompt, the reply the engine generated, and a few new tokens (a tool's result, the
next user message): the OpenAI endpoint builds it exactly so (`openai_sessions`). Without this cache every turn
prefilled the whole conversation again; with it a turn prefills only what is new. New episodes of the same env reuse
the system message and tools of any earlier sequence, since a hit may be any common prefix, not only a whole entry:
a position's K/V depends only on the tokens before it, so an entry cut at the first token that differs is exactly the
cache of the shorter prefix.

Entries are tagged with what computed them (the adapter, its version and the base version): a lookup uses only entries
of the batch's own tag, and a weight load drops the entries it makes stale. Batches that take a load between two decode
steps store nothing (their K/V mixes versions). Entries are evicted least recently used first, within `budget_bytes`.
Keeping a sequence copies its K/V out of the batch; a workload whose prompts never reuse one (single-turn tasks with
short prompts) would pay that for nothing, so after `patience_rows` rows in a row without a hit the cache stops
keeping sequences and frees its entries (`stats["prefix_stopped"]` = 1).
Only models whose every cache layer is the engine's full-attention layer take part (sliding-window layers keep a
window, not a sequence's whole K/V).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MIN_REUSE = 32  # a common prefix shorter than this (tokens) is prefilled again: copying it would not pay


@dataclass
class _Entry:
    tag: tuple
    tokens: np.ndarray  # [L] the sequence whose K/V is kept
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [H, L, D]
    nbytes: int


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """K/V of earlier sequences by tag; `lookup` finds each prompt's longest reusable prefix, `put` keeps a sequence.

    `stats` counts rows that reused a prefix (`prefix_hits`), the prompt tokens they did not prefill again
    (`prefix_tokens_reused`) and all prompt tokens looked up (`prefix_tokens_seen`); `bytes`/`entries` what is held.
    """

    def __init__(self, budget_bytes: int, patience_rows: int = 4096) -> None:
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes, self.patience_rows = budget_bytes, patience_rows
        self.rows_since_hit = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order: oldest first
        self._next = 0
        self.bytes = 0
        self.stats = {"prefix_hits": 0, "prefix_tokens_reused": 0, "prefix_tokens_seen": 0, "prefix_stopped": 0}

    @property
    def storing(self) -> bool:
        """Whether finished sequences are still kept (False once `patience_rows` rows in a row found nothing)."""
        return not self.stats["prefix_stopped"]

    @property
    def entries(self) -> int:
        return len(self._entries)

    @staticmethod
    def supports(cache: Any) -> bool:
        """Whether a batch's cache (`torch_kvcache.new_cache`) is one this cache can read and fill."""
        from astratk.engines.torch_kvcache import _GrowingLayer

        return bool(cache.layers) and all(type(layer) is _GrowingLayer for layer in cache.layers)

    def lookup(self, tag: tuple, prompts: list[tuple[int, ...]]
               ) -> list[tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int]]:
        """For each prompt: (K/V per layer of its longest reusable prefix cut to length m, m), or (None, 0). A prompt
        keeps at least its last token to prefill (its logits start decoding); a prefix under `MIN_REUSE` is not used."""
        out: list[tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int]] = []
        mine = [(key, e) for key, e in self._entries.items() if e.tag == tag]
        for prompt in prompts:
            self.stats["prefix_tokens_seen"] += len(prompt)
            arr = np.asarray(prompt, dtype=np.int64)
            best, m = None, 0
            for key, e in mine if len(prompt) > MIN_REUSE else ():
                n = min(_common(e.tokens, arr), len(prompt) - 1)
                if n > m:
                    best, m = key, n
            if best is None or m < MIN_REUSE:
                out.append((None, 0))
                self.rows_since_hit += 1
                continue
            self.rows_since_hit = 0
            self._entries.move_to_end(best)
            self.stats["prefix_hits"] += 1
            self.stats["prefix_tokens_reused"] += m
            out.append(([(k[:, :m], v[:, :m]) for k, v in self._entries[best].kv], m))
        if self.rows_since_hit > self.patience_rows and self.storing:
            self.stats["prefix_stopped"] = 1
            self.drop()
        return out

    def put(self, tag: tuple, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep `tokens`' K/V (per layer [H, L, D], owned by the cache from now on). A sequence that an entry of the
        same tag already holds whole is not kept twice, and entries that this one extends (an episode's earlier
        turns) are dropped."""
        if len(tokens) < MIN_REUSE or not self.storing:
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.budget_bytes:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        for key, e in list(self._entries.items()):
            if e.tag != tag or _common(e.tokens, arr) < min(len(e.tokens), len(arr)):
                continue
            if len(e.tokens) >= len(arr):  # held whole already
                self._entries.move_to_end(key)
                return
            self.bytes -= self._entries.pop(key).nbytes  # an earlier turn of this sequence: superseded
        while self.bytes + nbytes > self.budget_bytes and self._entries:
            self.bytes -= self._entries.popitem(last=False)[1].nbytes
        self._entries[self._next] = _Entry(tag, arr, kv, nbytes)
        self._next += 1
        self.bytes += nbytes

    def drop(self, keep: Any = None) -> None:
        """Forget every entry whose tag `keep(tag)` does not accept (None: forget all)."""
        for key in [k for k, e in self._entries.items() if keep is None or not keep(e.tag)]:
            self.bytes -= self._entries.pop(key).nbytes
