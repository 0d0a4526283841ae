"""The decode loop of `TorchEngine`: one batch of requests from its prefill to its last token, on the model's device.

`_Batch` holds a batch's tensors and runs each kind of step (prefill, sampling, one-token forward, recompute);
`decode` orders the steps and takes in-flight weight loads between them; `completions` turns its results into
`Completion`s. A new per-row setting goes into `_Batch`, and into `compact`, which moves every per-row tensor together.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from astratk import idle_cores
from astratk.contracts import Completion, GenerationRequest
from astratk.engines.torch_kvcache import new_cache
from astratk.engines.torch_lora_mix import MixedLora
from astratk.engines.torch_prefix_cache import PrefixCache
from astratk.engines.torch_sampling import _sample, _text_stop_hits, _TextStops, _topk_logprobs
from astratk.engines.torch_weights import InflightPacing
from astratk.models.kvcache import cache_kwargs


class _Clock:
    """Adds the wall time since its last lap to a stats counter (`TorchEngine.stats`: prefill_s, forward_s...)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats, self.last = stats, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[name] += now - self.last
        self.last = now


MIN_SHARED_PREFIX = 32  # a common prefix this long (tokens) is prefilled once for the whole batch


def shared_prefix(prompts: list[tuple[int, ...]]) -> int:
    """The length of the prefix every prompt shares, short of each prompt's last token (every row keeps at least one
    token of its own, whose logits start its decoding); 0 when it is under `MIN_SHARED_PREFIX` or all prompts are
    equal (a group's samples: prefilled once already)."""
    first = prompts[0]
    if all(x == first for x in prompts):
        return 0
    c = min(len(x) for x in prompts) - 1
    for x in prompts[1:]:
        i = 0
        while i < c and x[i] == first[i]:
            i += 1
        c = i
    return c if c >= MIN_SHARED_PREFIX else 0


def _padded(prompts: list[tuple[int, ...]], new_tokens: int, device: torch.device, cached: list[int]):
    """Prompt ids [B, P], attention mask [B, P + new_tokens] (0 on padding), prompt lengths [B], the shared prefix's
    length c and the width w of the reused prefixes. Each row is the shared prefix, then padding, then the rest of its
    prompt (right-aligned at P): with no shared prefix that is plain left padding. With rows whose first `cached[i]`
    tokens come from the prefix cache, each row is instead its cached prefix right-aligned at w = max(cached), then the
    rest right-aligned at P (c is then 0). Padding inside a row is masked like padding at its start, and positions
    count real tokens only, so a row computes what it would alone."""
    w = max(cached, default=0)
    if w:
        r = max(len(x) - m for x, m in zip(prompts, cached, strict=True))
        rows = [([0] * (w - m) + list(x[:m]) + [0] * (r - len(x) + m) + list(x[m:]),
                 [0] * (w - m) + [1] * m + [0] * (r - len(x) + m) + [1] * (len(x) - m))
                for x, m in zip(prompts, cached, strict=True)]
        c, p = 0, w + r
    else:
        c, p = shared_prefix(prompts), max(map(len, prompts))
        rows = [(list(x[:c]) + [0] * (p - len(x)) + list(x[c:]), [1] * c + [0] * (p - len(x)) + [1] * (len(x) - c))
                for x in prompts]
    ids = torch.tensor([ids for ids, _ in rows], device=device)
    mask = torch.ones(len(prompts), p + new_tokens, dtype=torch.long, device=device)
    mask[:, :p] = torch.tensor([m for _, m in rows], device=device)
    return ids, mask, torch.tensor([len(x) for x in prompts], device=device), c, w


class _Batch:
    """One batch's tensors on `device`: prompts, per-row settings, the KV cache and the outputs [B, N]. Finished rows
    are compacted away; `rows` maps the rows still decoding to their request's index (the outputs' row).

    With a `PrefixCache` (`torch_prefix_cache`), rows whose prompt extends a sequence run before start from its K/V,
    and each finished row's sequence is kept for later batches (`harvest`) unless `keep` was turned off (a weight load
    between decode steps: its K/V mixes versions).

    With a `MixedLora` (`torch_lora_mix`), the rows run different LoRA adapters in one forward: `slots` names each
    request's PEFT slot (None: the base), rows grouped by slot, and `tags` each row's prefix-cache tag. A prefix all
    prompts share is then prefilled once per adapter, and equal prompts share a prefill only within an adapter."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, requests: list[GenerationRequest],
                 seeds: torch.Tensor, device: torch.device, prefix_cache: PrefixCache | None = None,
                 tags: list[tuple] | None = None, mix: MixedLora | None = None,
                 slots: list[str | None] | None = None) -> None:
        self.model, self.tokenizer, self.requests, dev = model, tokenizer, requests, device
        self.mix, self.slots = mix, slots if mix is not None else [None] * len(requests)
        self.n = max(r.params.max_tokens for r in requests)
        self.k = max(r.params.top_k_logprobs for r in requests)
        prompts = [tuple(r.prompt_ids) for r in requests]
        if prefix_cache is not None and not PrefixCache.supports(new_cache(model, 1)):
            prefix_cache = None
        self.prefix_cache, self.keep = prefix_cache, prefix_cache is not None
        self.tags = tags if tags is not None else [()] * len(requests)
        hits: list[tuple[Any, int]] = [(None, 0)] * len(prompts)
        for tag in dict.fromkeys(self.tags) if prefix_cache is not None else ():  # one lookup per tag, in row order
            rows = [i for i, t in enumerate(self.tags) if t == tag]
            for i, hit in zip(rows, prefix_cache.lookup(tag, [prompts[i] for i in rows]), strict=True):
                hits[i] = hit
        self.hits = [kv for kv, _ in hits]  # per row: the reused prefix's K/V per layer, or None
        # [B, P], [B, P+N], [B]
        self.ids, self.mask, self.next_pos, self.prefix, self.reused = _padded(prompts, self.n, dev,
                                                                               [m for _, m in hits])
        self.p = self.ids.shape[1]
        self.temps = torch.tensor([r.params.temperature for r in requests], device=dev)  # [B]
        self.budgets = torch.tensor([r.params.max_tokens for r in requests], device=dev)  # [B]
        width = max(1, max(len(r.params.stop_token_ids) for r in requests))
        self.stops = torch.tensor([list(r.params.stop_token_ids) + [-1] * (width - len(r.params.stop_token_ids))
                                   for r in requests], device=dev)  # [B, S], -1 = no stop
        self.seeds = seeds  # [B]
        self.cache = new_cache(model, self.p + self.n)

    def prefill(self) -> torch.Tensor:
        """The prompts through the model into the cache; returns the last logits [B, V]. Equal prompts (a group's
        samples) are prefilled once; their cache rows and last logits are then indexed out per request, which is what
        each row's own prefill would compute. A prefix all prompts share (an agent's system message and tools) is
        prefilled once, on one row, and its cache copied to every row before the rest of each prompt. Rows with a
        reused prefix start from its K/V and prefill only the rest (then no shared prefix is looked for)."""
        requests, dev, p, c, w, slots = self.requests, self.ids.device, self.p, self.prefix, self.reused, self.slots
        pos = (self.mask[:, :p].cumsum(1) - 1).clamp(min=0)
        first: dict[tuple, int] = {}  # (slot, prompt) -> its first row
        for i, r in enumerate(requests):
            first.setdefault((slots[i], tuple(r.prompt_ids)), i)
        shared = len(first) < len(requests)
        unique = torch.tensor(list(first.values()), device=dev) if shared else slice(None)  # [U] rows
        if w:
            for j, layer in enumerate(self.cache.layers):
                layer.preload([None if self.hits[i] is None else self.hits[i][j] for i in first.values()], w)
        elif c:  # once per adapter: the first row of each adapter's rows, then copied to that adapter's rows
            leads: list[int] = []  # per adapter: its first row
            group: list[int] = []  # per unique row: its adapter's index in `leads`
            for i in first.values():
                if not leads or slots[i] != slots[leads[-1]]:
                    leads.append(i)
                group.append(len(leads) - 1)
            self._rows([slots[i] for i in leads])
            self.model(input_ids=self.ids[leads, :c], attention_mask=self.mask[leads, :c],
                       position_ids=pos[leads, :c], use_cache=True, logits_to_keep=1,
                       **cache_kwargs(self.model, self.cache))
            self.cache.batch_select_indices(torch.tensor(group, device=dev))  # [U] copies of its adapter's prefix
        self.hits = None
        start = w or c
        self._rows([slots[i] for i in first.values()])
        logits = self.model(input_ids=self.ids[unique, start:], attention_mask=self.mask[unique, :p],
                            position_ids=pos[unique, start:], use_cache=True, logits_to_keep=1,
                            **cache_kwargs(self.model, self.cache)).logits[:, -1]  # [U, V]
        if shared:
            slot = {key: j for j, key in enumerate(first)}
            expand = torch.tensor([slot[(slots[i], tuple(r.prompt_ids))] for i, r in enumerate(requests)],
                                  device=dev)  # [B] -> its prompt
            self.cache.batch_select_indices(expand)
            logits = logits[expand]  # [B, V]
        self._rows(slots)
        self._outputs()
        return logits

    def _rows(self, slots: list[str | None]) -> None:
        """The adapter of each row of the next forward (a mixed batch only)."""
        if self.mix is not None:
            self.mix.set_rows(slots)

    def _outputs(self) -> None:
        """The outputs and the per-row state of decoding, allocated once the prefill's activations are gone."""
        b, n, k, dev, requests = len(self.requests), self.n, self.k, self.ids.device, self.requests
        self.out_tokens, self.out_lp = torch.zeros(b, n, dtype=torch.long, device=dev), torch.zeros(b, n, device=dev)
        self.lengths = torch.zeros(b, dtype=torch.long, device=dev)
        self.stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        self.top_ids = torch.zeros(b, n, k, dtype=torch.long, device=dev) if k else None
        self.top_lp = torch.zeros(b, n, k, device=dev) if k else None
        self.rows = torch.arange(b, device=dev)  # original index of each row still in the batch
        self.alive = torch.ones(b, dtype=torch.bool, device=dev)
        self.text_stops = {i: _TextStops(r.params.stop) for i, r in enumerate(requests) if r.params.stop}  # by row
        self.wants_text = torch.tensor([bool(r.params.stop) for r in requests], device=dev)  # [B]

    def sample(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, int]:
        """Token `step` of every row still in the batch, recorded with its log-probs; rows that stop or reach their
        budget finish. Returns the tokens [R] and how many rows are still decoding."""
        rows, alive = self.rows, self.alive
        tok, lp = _sample(logits, self.temps, self.seeds, step)
        self.out_tokens[rows, step], self.out_lp[rows, step] = tok, lp
        if self.k:
            self.top_lp[rows, step], self.top_ids[rows, step] = _topk_logprobs(logits, self.temps, self.k)
        hit = (tok.unsqueeze(1) == self.stops).any(1)
        if self.text_stops:  # only batches with stop strings pay for decoding text
            hit |= _text_stop_hits(self.tokenizer, self.text_stops, rows, tok, alive & self.wants_text)
        done = alive & (hit | (self.budgets <= step + 1))
        self.lengths[rows[done]] = step + 1
        self.stopped[rows[done]] = hit[done]
        alive &= ~done
        return tok, int(alive.sum())

    def compact(self, tok: torch.Tensor, n_alive: int) -> torch.Tensor:
        """Drop finished rows once they are a quarter of the batch (they stop costing compute); returns `tok` for the
        rows kept."""
        if 4 * (len(self.rows) - n_alive) < len(self.rows):
            return tok
        self.harvest((~self.alive).nonzero().squeeze(1).tolist())
        keep = self.alive.nonzero().squeeze(1)
        self.cache.batch_select_indices(keep)
        (self.rows, self.temps, self.seeds, self.budgets, self.stops, self.wants_text, self.next_pos, self.mask, tok,
         self.alive) = (x[keep] for x in (self.rows, self.temps, self.seeds, self.budgets, self.stops, self.wants_text,
                                          self.next_pos, self.mask, tok, self.alive))
        self._rows([self.slots[i] for i in self.rows.tolist()])
        return tok

    def harvest(self, finished: list[int]) -> None:
        """Keep the sequences of finished rows (indices into the batch as it stands) in the prefix cache: the prompt and
        every generated token but the last, the ones fed through the model."""
        if not self.keep or not self.prefix_cache.storing:
            return
        for j in finished:
            i, n = int(self.rows[j]), int(self.lengths[self.rows[j]])
            fed = torch.arange(self.p, self.p + n - 1, device=self.mask.device)
            positions = torch.cat([self.mask[j, :self.p].nonzero().squeeze(1), fed])
            tokens = list(self.requests[i].prompt_ids) + self.out_tokens[i, :n - 1].tolist()
            self.prefix_cache.put(self.tags[i], tokens, [layer.row(j, positions) for layer in self.cache.layers])

    def forward(self, tok: torch.Tensor, step: int) -> torch.Tensor:
        """Token `step` of each row through the model (one position, through the cache); returns the next logits."""
        logits = self.model(input_ids=tok.unsqueeze(1), attention_mask=self.mask[:, :self.p + step + 1],
                            position_ids=self.next_pos.unsqueeze(1), use_cache=True,
                            **cache_kwargs(self.model, self.cache)).logits[:, -1]
        self.next_pos = self.next_pos + 1
        return logits

    def recompute(self, step: int) -> torch.Tensor:
        """As if each row were aborted and resubmitted with its prefix: prompt and tokens 0..`step` prefilled again into
        a new cache (the KV computed under the old weights is dropped); returns the next logits."""
        seq = torch.cat([self.ids[self.rows], self.out_tokens[self.rows, :step + 1]], dim=1)  # [R, P + step + 1]
        seq_mask = self.mask[:, :self.p + step + 1]
        self.cache = new_cache(self.model, self.p + self.n)
        logits = self.model(input_ids=seq, attention_mask=seq_mask, position_ids=(seq_mask.cumsum(1) - 1).clamp(min=0),
                            use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, self.cache)).logits[:, -1]
        self.next_pos = self.next_pos + 1
        return logits

    def results(self, step_versions: list[int]) -> tuple:
        """The outputs on the CPU (`decode` says what each is), with the version of each step's token."""
        cpu = (lambda x: None if x is None else x.cpu())
        return (self.out_tokens.cpu(), self.out_lp.cpu(), self.lengths.cpu(), self.stopped.cpu(), cpu(self.top_ids),
                cpu(self.top_lp), step_versions)


def decode(model: torch.nn.Module, tokenizer: Any, requests: list[GenerationRequest], seeds: torch.Tensor,
           version: int, *, device: torch.device, stats: dict[str, Any], weight_updates: str,
           take_loads: Callable[[], int | None], prefix_cache: PrefixCache | None = None,
           tags: list[tuple] | None = None, mix: MixedLora | None = None, slots: list[str | None] | None = None
           ) -> tuple:
    """Prefill + decode one batch with `version`'s weights. Returns tokens [B, N], logprobs [B, N], lengths [B],
    stopped [B], top-K ids and log-probs [B, N, K] when a request asks for them (else None, None), all on CPU, and the
    version of the weights that produced each step's token ([N]: one version throughout, except in in-flight mode,
    where `take_loads` lets waiting loads run between two steps and returns the version now served, or None).
    `prefix_cache`: reuse and keep sequences' K/V across batches, under each row's tag in `tags`
    (`torch_prefix_cache`). `mix`, `slots`: a batch whose rows run different LoRA adapters (`_Batch`); weights are
    then never loaded mid-batch."""
    if mix is not None and weight_updates != "between_requests":
        raise ValueError("a batch that mixes adapters takes no weight load between decode steps")
    batch = _Batch(model, tokenizer, requests, seeds, device, prefix_cache, tags, mix, slots)
    with mix.applied() if mix is not None else contextlib.nullcontext():
        return _steps(batch, version, stats, weight_updates, take_loads)


def _steps(batch: _Batch, version: int, stats: dict[str, Any], weight_updates: str,
           take_loads: Callable[[], int | None]) -> tuple:
    """`decode`'s loop: the prefill, then sample and forward one token at a time, taking loads where due."""
    clock = _Clock(stats)  # where the batch's time goes (`stats`)
    idle_cores.adjust()  # this thread's torch threads: its own, plus a waiting trainer's (`astratk.idle_cores`)
    try:
        return _decode_steps(batch, version, stats, weight_updates, take_loads, clock)
    finally:
        idle_cores.settle()


def _decode_steps(batch: _Batch, version: int, stats: dict[str, Any], weight_updates: str,
                  take_loads: Callable[[], int | None], clock: _Clock) -> tuple:
    logits = batch.prefill()
    clock.lap("prefill_s")
    pacing = InflightPacing(weight_updates)
    step_versions: list[int] = []
    for step in range(batch.n):
        step_versions.append(version)  # the weights that computed `logits`
        tok, n_alive = batch.sample(logits, step)
        clock.lap("sample_s")
        if n_alive == 0:
            break
        tok = batch.compact(tok, n_alive)
        if pacing.due() and (loaded := take_loads()) is not None and loaded != version:
            version = loaded  # the next tokens come from the new weights
            stats["inflight_loads"] += 1
            batch.keep = False  # K/V from two versions: nothing of this batch is kept
            if pacing.recompute:
                started = time.perf_counter()
                logits = batch.recompute(step)
                stats["recompute_s"] += pacing.recomputed(started)
                clock.lap("prefill_s")
                continue
        idle_cores.adjust()
        logits = batch.forward(tok, step)
        pacing.forwarded()
        clock.lap("forward_s")
    batch.harvest([j for j in range(len(batch.rows)) if not batch.alive[j]])
    clock.lap("prefix_s")
    out = batch.results(step_versions)
    clock.lap("output_s")
    return out


def completions(requests: list[GenerationRequest], decoded: tuple, row_versions: list[int] | None = None
                ) -> list[Completion]:
    """One `Completion` per request from `decode`'s results: its tokens up to its length, their log-probs, versions
    and top-K log-probs (when it asked for them), and why it ended. `row_versions`: each row's version throughout (a
    batch that mixes adapters: each row carries its adapter's) instead of the batch's per step."""
    tokens, logprobs, lengths, stopped, top_ids, top_lp, step_versions = decoded
    tokens, logprobs, lengths, stopped = tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
    top_ids, top_lp = (top_ids.tolist(), top_lp.tolist()) if top_ids is not None else (None, None)
    out = []
    for i, n in enumerate(lengths):
        k = requests[i].params.top_k_logprobs
        topk = ((tuple(tuple(row[:k]) for row in top_ids[i][:n]), tuple(tuple(row[:k]) for row in top_lp[i][:n]))
                if k and top_ids is not None else ((), ()))
        versions = tuple(step_versions[:n]) if row_versions is None else (row_versions[i],) * n
        out.append(Completion(tuple(tokens[i][:n]), tuple(logprobs[i][:n]), versions,
                              "stop" if stopped[i] else "length", *topk))
    return out
