"""`TorchEngine`: the built-in engine. An HF-transformers causal LM, a KV cache, batched sampling, a request batcher.

Batching. Episodes call `generate` concurrently (asyncio tasks in one loop, other threads, other loops). A call queues
its requests and gets a `concurrent.futures.Future` (`asyncio.wrap_future` makes it awaitable in the caller's loop).
One worker thread takes the first queued request, then waits while more keep arriving: until none has arrived for
`batch_window_s` (at most `BATCH_WAIT_MAX_S` in all, or until `max_batch`), runs them as one batch and resolves the
callers' futures; a call larger than `max_batch` spans batches. Why wait for the arrivals to stop rather than for a
fixed window: a rollout chunk's 64 episodes render their chat prompts before they call `generate`, so their requests
trickle in over several milliseconds, and a fixed 2 ms window cut them into a batch of 48 and one of 16 (measured:
1.3x fewer tokens/s than one batch). A lone request waits `batch_window_s` only. An exception in a batch
goes to the calls in that batch, and the worker carries on.

Decoding. Prompts are left-padded, position ids count each row's real tokens; one prefill (equal prompts, such as
a group's samples, once each), then one token per step through the KV cache (`astratk.models.kvcache`). A row stops at one of its `stop_token_ids` (kept in the completion) or at its `max_tokens`;
rows with different temperatures, budgets and stops share a batch, and finished rows are compacted away once they are
a quarter of it. Stop strings (`params.stop`, needs a tokenizer) end a row at the token whose text completes one, kept
too: only rows that have them decode, each step, a short tail of their generated tokens (`_text_stop_hits`).
Sampling is inverse-CDF on softmax(logits / T), no top-k / top-p (so r = 1 on-policy); T = 0 is greedy, scored with the
untempered softmax. Behaviour log-probs come from `logprobs_from_logits`, the trainer's formula.

Devices and memory. `device` (auto, cpu, cuda, cuda:N) and `dtype` (auto, float32, bfloat16, float16) come from
`rollout.engine_args`; auto is the GPU in bf16 when torch sees one (`astratk.gpu`), else the CPU in fp32. Everything a
batch computes (ids, masks, the KV cache, seeds, samples) lives on the model's device; results come back to the CPU
once per batch. `gpu_memory_utilization` (vLLM's name and meaning: this engine's fraction of the GPU's memory) caps
this process's CUDA allocator at that share and cuts batches so that the weights, the KV cache and the activations
fit (`astratk.engines.memory`); the engine prints what the budget allows when it starts.

Seeds. Random numbers are a counter-based hash of (row seed, token index), so a request with `params.seed` gets the
same completion whatever shares its batch; unseeded rows draw a seed from the engine's generator (`seed=`). Equal
seeds and prompts give equal completions: give each episode of a group its own seed, or none.

Weights and versions. `load_weights` copies tensors into the parameters under the lock a running batch holds, so a
batch in flight finishes on the weights it started with and every token of a completion carries that batch's version.
The KV cache lives only inside a batch, so nothing computed under old weights outlives a load, which therefore waits
for at most the batch in flight. A `SparseDelta` is written in place under the same lock, and only onto the version it
was made from (`base_version` must equal the engine's version when the lock is taken; otherwise the load fails and
changes nothing, and the caller fetches a full state). Both kinds check names and shapes before the first write.

LoRA adapters. `add_adapter(name, lora, state, version)` attaches a PEFT LoRA adapter to the model (the base is
held once, however many adapters) and returns its `AdapterView` (`astratk.engines.adapters`), whose requests name
the adapter. A batch runs rows of one adapter (or of the base alone): the batcher takes the oldest queued request's
adapter and the queued requests of that adapter, so each adapter keeps its requests' order and none waits behind
more than the batches ahead of it. An adapter's `load_weights` (its tensors by saved PEFT name, or a `SparseDelta`
from its version) takes the same lock, so the guarantees above hold per adapter and every token carries the version
of its adapter. An engine without adapters runs exactly as before.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from astratk.contracts import Completion, GenerationRequest, expand_samples, fit_context
from astratk.engines.adapters import AdapterView
from astratk.engines.memory import MARGIN, MemoryBudget, model_budget
from astratk.gpu import check_fraction, reserve_memory, resolve_device, resolve_dtype
from astratk.models.kvcache import cache_kwargs
from astratk.models.loading import load_causal_lm, load_tokenizer
from astratk.weights.delta import SparseDelta, apply_delta

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_GQA_ATTENTION = "astratk_sdpa_gqa"


# ------------------------------------------------------------------------------------------- model-side speed-ups


def _sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention, except that masked single-token decode steps keep K/V grouped.

    Why: with a padding mask, transformers 5.19 repeats K/V once per query head on CPU (`repeat_kv` copies the whole
    cache in every layer at every step); torch's sdpa handles grouped heads itself (`enable_gqa`) with the same result
    (max difference 0 measured) at ~4x less time per call at batch 512. Everything else goes to HF's function.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or query.shape[2] != 1 or groups == 1 or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"),
                                         enable_gqa=True)  # [B, H, 1, D]
    return out.transpose(1, 2).contiguous(), None


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

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


# ---------------------------------------------------------------------------------------- counter-based sampling


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


# ------------------------------------------------------------------------------------------------------ engine


@dataclass(eq=False)
class _Call:
    """One `generate` call: its requests, their completions as they arrive, and the caller's future."""

    requests: list[GenerationRequest]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    adapter: str | None = None  # the LoRA adapter its requests run with (None: the base model)

    def __post_init__(self) -> None:
        self.results: list[Completion | None] = [None] * len(self.requests)
        self.remaining = len(self.requests)


WEIGHT_UPDATES = ("between_requests", "inflight", "inflight_recompute")
BATCH_WAIT_MAX_S = 0.05  # the longest a batch waits for requests still arriving (`_take_batch`)


class TorchEngine:
    """An HF causal LM served with batched sampling, per-token behaviour log-probs and versions.

    Example:
        >>> engine = TorchEngine("runs/x/model", max_batch=256)  # or .from_model(model, tokenizer)  # doctest: +SKIP
        >>> request = GenerationRequest((1, 2, 3), SamplingParams(max_tokens=8, seed=0))  # doctest: +SKIP
        >>> [c] = await engine.generate([request])  # concurrent calls share batches  # doctest: +SKIP
        >>> engine.load_weights(state, version=3)  # applied before the next batch  # doctest: +SKIP
        >>> engine.load_weights(make_delta(state, new_state, base_version=3, version=4), 4)  # doctest: +SKIP
        >>> engine.close()  # doctest: +SKIP
    """

    def __init__(self, model_path: str | os.PathLike, *, max_batch: int = 512, dtype: str = "auto",
                 device: str = "auto", gpu_memory_utilization: float | None = None, version: int = 0,
                 batch_window_s: float = 0.002, seed: int = 0, weight_updates: str = "between_requests") -> None:
        # keys as a run config names them (rollout.engine_args), where these arguments come from
        device = resolve_device(device, "rollout.engine_args.device")
        dtype = resolve_dtype(dtype, device, "rollout.engine_args.dtype")
        check_fraction(gpu_memory_utilization, "rollout.engine_args.gpu_memory_utilization")
        path = os.fspath(model_path)
        model = load_causal_lm(str(path), _DTYPES[dtype], device)
        has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)
        tokenizer = load_tokenizer(path) if has_tokenizer else None  # checked to round-trip text
        self._setup(model, tokenizer, max_batch=max_batch, version=version, batch_window_s=batch_window_s, seed=seed,
                    gpu_memory_utilization=gpu_memory_utilization, weight_updates=weight_updates)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, *, max_batch: int = 512, version: int = 0,
                   batch_window_s: float = 0.002, seed: int = 0, gpu_memory_utilization: float | None = None,
                   weight_updates: str = "between_requests") -> TorchEngine:
        """Serve an in-memory model (on its current device and dtype). The engine puts it in eval mode and, on CPU
        with sdpa attention, switches it to the grouped-K/V variant `_sdpa_gqa` (same outputs, faster decode)."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, max_batch=max_batch, version=version, batch_window_s=batch_window_s, seed=seed,
                    gpu_memory_utilization=check_fraction(gpu_memory_utilization,
                                                          "rollout.engine_args.gpu_memory_utilization"),
                    weight_updates=weight_updates)
        return self

    def _setup(self, model: torch.nn.Module, tokenizer: Any, *, max_batch: int, version: int,
               batch_window_s: float, seed: int, gpu_memory_utilization: float | None = None,
               weight_updates: str = "between_requests") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if weight_updates not in WEIGHT_UPDATES:
            raise ValueError(f"rollout.weight_updates must be one of {WEIGHT_UPDATES}, got {weight_updates!r}")
        self.weight_updates = weight_updates
        from astratk.cpu import use_linear_backend

        model = use_linear_backend(model)  # CPU Linear layers through oneDNN where it is faster (astratk.cpu)
        self._model, self._tokenizer, self._device = model.eval(), tokenizer, next(model.parameters()).device
        if self._device.type == "cpu" and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(_GQA_ATTENTION)  # only measured on CPU; CUDA keeps HF's own choice
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self._params = model.state_dict(keep_vars=True)  # names as saved (tied aliases too) -> live tensors
        self._max_batch, self._window, self._version = max_batch, batch_window_s, version
        self._generator = torch.Generator().manual_seed(seed)
        self._weights_lock = threading.Lock()  # held by a running batch and by load_weights
        self._loads_waiting = 0  # the worker lets a waiting load go before its next batch
        self._loads_done = 0  # loads finished (or failed): the worker lets go the ones waiting when it yields, no more
        self._broken: RuntimeError | None = None  # a full load that failed after writing part of the weights
        self._cond = threading.Condition()  # guards the queue, `closed` and `loads_waiting`
        self._pending: collections.deque[tuple[_Call, int]] = collections.deque()  # (call, request index)
        self._closed, self._worker = False, None
        self._stats = {"batches": 0, "requests": 0, "tokens": 0, "max_batch_seen": 0, "errors": 0,
                       "budget_capped_batches": 0, "inflight_loads": 0, "recompute_s": 0.0,
                       "prefill_s": 0.0, "forward_s": 0.0, "sample_s": 0.0, "output_s": 0.0}
        self._memory, self._release_memory = self._budget(gpu_memory_utilization)
        self._adapters: dict[str, _Adapter] = {}  # LoRA adapters by name (module docstring)
        self._active: str | None | object = None  # the adapter the model applies now (None: the base alone)

    # ------------------------------------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int | None:
        """Positions the model holds, prompt and completion together (its config's `max_position_embeddings`; None
        when it has none): requests are cut to fit it (`fit_context`)."""
        n = getattr(getattr(self._model, "config", None), "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def stats(self) -> dict[str, int | float]:
        """Counters since construction: batches run, requests and tokens served, largest batch, failed batches,
        batches cut short by the memory budget, weight loads taken between decode steps, seconds spent prefilling
        prefixes again (`inflight_recompute`), and where batch time went: `prefill_s` (prompts through the model),
        `forward_s` (one-token decode forwards), `sample_s` (sampling with its log-probs, top-K log-probs, stops),
        `output_s` (results back to the CPU and into completions). On a CPU these are wall times; on a GPU the
        parts run asynchronously and only their sum is meaningful."""
        return dict(self._stats)

    @property
    def memory(self) -> MemoryBudget | None:
        """The GPU memory budget the batcher keeps to (`gpu_memory_utilization`); None: no budget, or the CPU."""
        return self._memory

    def _budget(self, fraction: float | None) -> tuple[MemoryBudget | None, Any]:
        """The budget on a GPU, with this process's allocator capped at it (added to other holders' shares; the
        second value gives it back). On the CPU a budget does not apply: a config that sets one for GPU machines
        runs unchanged on a laptop."""
        if fraction is None or self._device.type != "cuda":
            return None, None
        budget = model_budget(self._model, str(self._device), fraction)
        if budget.free_bytes <= 0:
            raise ValueError(f"rollout.engine_args.gpu_memory_utilization {fraction} of {self._device} is "
                             f"{budget.budget_bytes / 2**30:.2f} GiB, not more than the weights "
                             f"({budget.weight_bytes / 2**30:.2f} GiB) and a {int(100 * MARGIN)}% margin; raise it")
        release = reserve_memory(self._device, fraction, self)
        # A budget the user set is reported where the engine runs (a local cluster's workers print to its console).
        print(budget.describe(self._max_batch), flush=True)
        return budget, release

    def _fits(self, rows: int, prompt_width: int, new_tokens: int) -> bool:
        """Whether a batch of `rows` rows, prompts padded to `prompt_width`, up to `new_tokens` new tokens, stays
        within the memory budget (no budget: always)."""
        if self._memory is None:
            return True
        if self.weight_updates == "inflight_recompute":  # a recompute prefills prompt + tokens so far at once
            prompt_width += new_tokens
        return self._memory.rows(prompt_width, new_tokens) >= rows

    def submit(self, requests: Sequence[GenerationRequest], adapter: str | None = None) -> concurrent.futures.Future:
        """Queue requests from any thread; the future resolves to their completions, in order (n per request).
        `adapter`: the LoRA adapter to run them with (`add_adapter`; None: the base model). A request's token budget
        is cut to the room its prompt leaves in the model's context, and a prompt that leaves none raises
        `PromptTooLong` (`fit_context`): rotary positions past the trained ones would produce garbage, slowly."""
        limit = self.max_model_len
        call = _Call([fit_context(r, limit) for r in expand_samples(requests)], adapter=adapter)
        if adapter is not None:
            self._adapter(adapter)
        for r in call.requests:
            self._validate(r)
        if not call.requests:
            call.future.set_result([])
            return call.future
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            if self._broken is not None:
                raise RuntimeError(str(self._broken)) from self._broken.__cause__
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="TorchEngine-batcher", daemon=True)
                self._worker.start()
            self._pending.extend((call, i) for i in range(len(call.requests)))
            self._cond.notify()
        return call.future

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        return await asyncio.wrap_future(self.submit(requests))

    def load_weights(self, state: Mapping[str, torch.Tensor] | SparseDelta, version: int,
                     adapter: str | None = None) -> None:
        """Copy `state` (any subset of the model's parameter names) into the model, or write a `SparseDelta` made
        from the engine's current version into it; applied between batches. With `adapter`, the same for that LoRA
        adapter's tensors (by saved PEFT name) and version."""
        slot = None if adapter is None else self._adapter(adapter)
        params = self._params if slot is None else slot.tensors
        if isinstance(state, SparseDelta):
            if state.version != version:
                raise ValueError(f"load_weights: the delta produces version {state.version}, not {version}")
        else:
            self._check_state(state, params)
        with self._cond:
            self._loads_waiting += 1
        try:
            with self._weights_lock, torch.no_grad():
                current = self._version if slot is None else slot.version
                if not isinstance(state, SparseDelta):
                    written = 0
                    try:
                        for name, tensor in state.items():
                            params[name].copy_(tensor)
                            written += 1
                    except Exception as e:
                        if written:  # neither version now: refuse work until the service rebuilds the engine
                            self._broken = RuntimeError(
                                f"TorchEngine is broken: the load of version {version} failed after writing {written} "
                                f"of {len(state)} tensors ({type(e).__name__}: {e}); its weights are neither version "
                                f"{current} nor {version}. The rollout service rebuilds it at its next sync")
                            self._broken.__cause__ = e
                        raise
                elif state.base_version != current:  # checked under the lock: a load in between moves it
                    raise ValueError(f"load_weights: the engine is at version {current} and the delta needs "
                                     f"base version {state.base_version}; fetch a full state instead")
                else:
                    apply_delta(params, state)  # checks every name, shape and dtype before writing any
                if slot is None:
                    self._version = version
                else:
                    slot.version = version
        finally:
            with self._cond:
                self._loads_waiting -= 1
                self._loads_done += 1

    @property
    def broken(self) -> RuntimeError | None:
        """Why the engine refuses work (a full load failed half-way: its weights are neither version), or None. The
        rollout service replaces a broken engine at its next sync."""
        return self._broken

    def _let_loads_go(self) -> None:
        """Wait until the loads waiting now have run (not the ones that arrive meanwhile: a stream of loads cannot
        starve generation)."""
        with self._cond:
            target = self._loads_done + self._loads_waiting
        while self._loads_waiting and self._loads_done < target:
            time.sleep(1e-4)

    # ------------------------------------------------------------------------------------------------ adapters
    def add_adapter(self, name: str, lora: Any, state: Mapping[str, torch.Tensor], version: int) -> Any:
        """Attach LoRA adapter `name` (`lora`: its `LoraSpec`) with tensors `state` (by saved PEFT name, as the
        trainer publishes them) at `version`; returns its `AdapterView`. Waits for the batch in flight."""
        from astratk.models.lora import inject_adapter, remove_adapter

        if name in self._adapters:
            raise ValueError(f"add_adapter: the engine already has an adapter {name!r}; load_weights moves it")
        dtype = next(t for t in self._params.values() if t.is_floating_point()).dtype
        slot = f"astratk{len(self._adapters)}"  # PEFT's module-dict key (no dots): the user's name may have any
        with self._weights_lock, torch.no_grad():
            tensors = inject_adapter(self._model, lora, slot, dtype)
            try:
                self._check_state(state, tensors)
                if missing := sorted(set(tensors) - set(state)):
                    raise KeyError(f"add_adapter: {len(missing)} adapter tensors missing from the state, e.g. "
                                   f"{missing[:2]}")
                for key, tensor in state.items():
                    tensors[key].copy_(tensor)
            except BaseException:
                remove_adapter(self._model, slot)
                self._active = _UNKNOWN  # PEFT may have switched the active adapter
                raise
            self._active = _UNKNOWN
            self._adapters[name] = _Adapter(slot, tensors, version)
        return AdapterView(self, name)

    def adapter(self, name: str) -> Any:
        """The `AdapterView` of adapter `name`."""

        self._adapter(name)
        return AdapterView(self, name)

    def adapter_version(self, name: str) -> int:
        return self._adapter(name).version

    @property
    def adapters(self) -> list[str]:
        """The names of the attached LoRA adapters."""
        return list(self._adapters)

    def _adapter(self, name: str) -> _Adapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise KeyError(f"the engine has no adapter {name!r} (adapters: {sorted(self._adapters)}); attach it "
                           "with add_adapter") from None

    def _activate(self, adapter: str | None) -> int:
        """Under the weights lock: make the model apply `adapter` (None: the base alone); returns its version."""
        if adapter != self._active:
            from astratk.models.lora import activate

            activate(self._model, None if adapter is None else self._adapters[adapter].slot)
            self._active = adapter
        return self._version if adapter is None else self._adapters[adapter].version

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker after its current batch; queued calls fail with RuntimeError."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for call, _ in pending:
            _settle(call.future, error=RuntimeError("engine closed before this request ran"))
        try:
            if self._worker is not None and self._worker is not threading.current_thread():
                self._worker.join(timeout_s)
                if self._worker.is_alive():
                    raise TimeoutError(f"TorchEngine worker still running its batch after {timeout_s}s at close()")
        finally:
            if self._release_memory is not None:  # this process's share of the GPU, given back
                self._release_memory()

    def __enter__(self) -> TorchEngine:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        dtype = next(self._model.parameters()).dtype
        return f"TorchEngine({type(self._model).__name__}, version={self._version}, device={self._device}, {dtype})"

    # ------------------------------------------------------------------------------------------------ batcher
    def _validate(self, r: GenerationRequest) -> None:
        """Reject a bad request at its caller, before it can fail a batch shared with others."""
        check_prompt(r, self._vocab)
        if self._memory is not None and self._memory.rows(len(r.prompt_ids), r.params.max_tokens) < 1:
            need = self._memory.row_bytes(len(r.prompt_ids), r.params.max_tokens)
            raise ValueError(f"a request of {len(r.prompt_ids)} prompt + {r.params.max_tokens} new tokens needs "
                             f"{need / 2**20:.0f} MiB on {self._device}, more than the "
                             f"{max(0, self._memory.free_bytes) / 2**20:.0f} MiB the engine's budget leaves after the "
                             "weights; raise rollout.engine_args.gpu_memory_utilization or shorten the request")
        if r.params.stop and self._tokenizer is None:
            raise ValueError(f"stop strings {r.params.stop!r} need an engine with a tokenizer: give one to "
                             "TorchEngine.from_model(model, tokenizer), or serve a model directory with tokenizer "
                             "files; or stop on token ids (stop_token_ids)")

    def _check_state(self, state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
        """Reject a full state `params` (the model's, or an adapter's) cannot take before waiting for the lock
        (deltas: `apply_delta` checks)."""
        if unknown := sorted(set(state) - set(params)):
            raise KeyError(f"load_weights: {len(unknown)} names the model lacks, e.g. {unknown[:3]}; expected names "
                           f"like {sorted(params)[:3]}")
        if bad := [(k, tuple(v.shape)) for k, v in state.items() if v.shape != params[k].shape]:
            raise ValueError(f"load_weights: shape mismatch for {bad[:3]}; the model's are "
                             f"{[tuple(params[k].shape) for k, _ in bad[:3]]}")

    def _serve(self) -> None:
        try:
            while (items := self._take_batch()) is not None:
                if items:
                    self._serve_batch(items)
        finally:  # normally after close(); if the worker itself broke, nobody may wait forever
            self.close(timeout_s=0)

    def _serve_batch(self, items: list[tuple[_Call, int]]) -> None:
        try:
            completions = self._run_batch([call.requests[i] for call, i in items], items[0][0].adapter)
        except Exception as e:  # noqa: BLE001 - the batch's callers get it; the worker keeps serving
            self._stats["errors"] += 1
            for call in {id(c): c for c, _ in items}.values():
                _settle(call.future, error=e)
            return
        for (call, i), completion in zip(items, completions):
            call.results[i] = completion
            call.remaining -= 1
            if call.remaining == 0:
                _settle(call.future, result=call.results)

    def _take_batch(self) -> list[tuple[_Call, int]] | None:
        """Wait for a first request, then while more keep arriving (module docstring); None once closed."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait(timeout=1.0)  # idle: re-check `closed` every second
            if self._closed:
                return None
            give_up = time.monotonic() + BATCH_WAIT_MAX_S
            seen, quiet_until = len(self._pending), time.monotonic() + self._window
            while len(self._pending) < self._max_batch and (now := time.monotonic()) < give_up:
                if len(self._pending) != seen:  # another request arrived: wait a window more for the next
                    seen, quiet_until = len(self._pending), now + self._window
                if now >= quiet_until:
                    break
                self._cond.wait(timeout=min(quiet_until, give_up) - now)
            items: list[tuple[_Call, int]] = []
            others: collections.deque[tuple[_Call, int]] = collections.deque()  # other adapters' requests
            full = False  # the memory budget holds no more rows: the rest waits for the next batch, in order
            width = new = 0  # the batch's longest prompt and largest token budget so far
            while self._pending and len(items) < self._max_batch:
                call, i = self._pending.popleft()
                if call.future.done():  # skip calls already failed or cancelled
                    continue
                r = call.requests[i]
                wider, longer = max(width, len(r.prompt_ids)), max(new, r.params.max_tokens)
                if items and call.adapter != items[0][0].adapter:  # a batch runs one adapter's rows
                    others.append((call, i))
                elif items and (full or not self._fits(len(items) + 1, wider, longer)):
                    full = True
                    others.append((call, i))
                else:
                    items.append((call, i))
                    width, new = wider, longer
            self._stats["budget_capped_batches"] += full
            if others:  # back to the front, in their order
                others.extend(self._pending)
                self._pending = others
        self._let_loads_go()  # a waiting load_weights takes the lock first
        return items

    # ------------------------------------------------------------------------------------------------ decoding
    def _run_batch(self, requests: list[GenerationRequest], adapter: str | None = None) -> list[Completion]:
        with self._weights_lock, torch.inference_mode():
            version = self._activate(adapter) if self._adapters else self._version
            tokens, logprobs, lengths, stopped, top_ids, top_lp, step_versions = self._decode(requests, adapter, version)
        started = time.perf_counter()
        tokens, logprobs, lengths, stopped = tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
        top_ids, top_lp = (top_ids.tolist(), top_lp.tolist()) if top_ids is not None else (None, None)
        out = []
        for i, n in enumerate(lengths):
            k = requests[i].params.top_k_logprobs
            topk = ((tuple(tuple(row[:k]) for row in top_ids[i][:n]), tuple(tuple(row[:k]) for row in top_lp[i][:n]))
                    if k and top_ids is not None else ((), ()))
            out.append(Completion(tuple(tokens[i][:n]), tuple(logprobs[i][:n]), tuple(step_versions[:n]),
                                  "stop" if stopped[i] else "length", *topk))
        s = self._stats
        s.update(batches=s["batches"] + 1, requests=s["requests"] + len(requests), tokens=s["tokens"] + sum(lengths),
                 max_batch_seen=max(s["max_batch_seen"], len(requests)),
                 output_s=s["output_s"] + time.perf_counter() - started)
        return out

    def _yield_to_loads(self, adapter: str | None) -> int | None:
        """In-flight mode, between two decode steps, under the weights lock: let waiting `load_weights` calls run
        (the batch's KV cache is kept), then take the lock back; returns the version now served, or None when no load
        was waiting."""
        if not self._loads_waiting:
            return None
        self._weights_lock.release()
        try:
            self._let_loads_go()  # each waiting load takes the lock in turn
        finally:
            self._weights_lock.acquire()
        if self._broken is not None:  # the batch must not go on with half-written weights
            raise self._broken
        if adapter is not None:
            self._active = object()  # a load may have re-activated nothing; make the next line re-apply it
            return self._activate(adapter)
        return self._version

    def _decode(self, requests: list[GenerationRequest], adapter: str | None = None, version: int = 0):
        """Prefill + decode one batch. Returns tokens [B, N], logprobs [B, N], lengths [B], stopped [B], top-K ids and
        log-probs [B, N, K] when a request asks for them (else None, None), all on CPU, and the version of the
        weights that produced each step's token ([N]: one version throughout, except in in-flight mode)."""
        dev, b, n = self._device, len(requests), max(r.params.max_tokens for r in requests)
        k = max(r.params.top_k_logprobs for r in requests)
        ids, mask, next_pos = _left_padded([r.prompt_ids for r in requests], n, dev)  # [B, P], [B, P+N], [B]
        p = ids.shape[1]
        temps = torch.tensor([r.params.temperature for r in requests], device=dev)  # [B]
        budgets = torch.tensor([r.params.max_tokens for r in requests], device=dev)  # [B]
        width = max(1, max(len(r.params.stop_token_ids) for r in requests))
        stops = torch.tensor([list(r.params.stop_token_ids) + [-1] * (width - len(r.params.stop_token_ids))
                              for r in requests], device=dev)  # [B, S], -1 = no stop
        seeds = self._row_seeds(requests).to(dev)  # [B]
        cache = self._new_cache(p + n)
        pos = (mask[:, :p].cumsum(1) - 1).clamp(min=0)
        # Equal prompts (a group's samples) are prefilled once; their cache rows and last logits are then indexed out
        # per request, which is what each row's own prefill would compute.
        first: dict[tuple[int, ...], int] = {}  # prompt -> its first row
        for i, r in enumerate(requests):
            first.setdefault(tuple(r.prompt_ids), i)
        shared = len(first) < b
        unique = torch.tensor(list(first.values()), device=dev) if shared else slice(None)  # [U] rows
        clock = _Clock(self._stats)  # where the batch's time goes (`stats`)
        logits = self._model(input_ids=ids[unique], attention_mask=mask[unique, :p], position_ids=pos[unique],
                             use_cache=True, logits_to_keep=1, **cache_kwargs(self._model, cache)).logits[:, -1]  # [U, V]
        if shared:
            slot = {prompt: j for j, prompt in enumerate(first)}
            expand = torch.tensor([slot[tuple(r.prompt_ids)] for r in requests], device=dev)  # [B] -> its prompt
            cache.batch_select_indices(expand)
            logits = logits[expand]  # [B, V]
        clock.lap("prefill_s")
        out_tokens, out_lp = torch.zeros(b, n, dtype=torch.long, device=dev), torch.zeros(b, n, device=dev)
        lengths, stopped = torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.bool, device=dev)
        top_ids = torch.zeros(b, n, k, dtype=torch.long, device=dev) if k else None
        top_lp = torch.zeros(b, n, k, device=dev) if k else None
        rows = torch.arange(b, device=dev)  # original index of each row still in the batch
        alive = torch.ones(b, dtype=torch.bool, device=dev)
        text_stops = {i: _TextStops(r.params.stop) for i, r in enumerate(requests) if r.params.stop}  # by row
        wants_text = torch.tensor([bool(r.params.stop) for r in requests], device=dev)  # [B]
        inflight = self.weight_updates != "between_requests"
        recompute = self.weight_updates == "inflight_recompute"
        # A recompute prefills every running prefix again. Versions published faster than that would make each token
        # pay a whole prefill (decoding stalls: measured 26x slower at a version every 0.3 s), so the next in-flight
        # load is taken only after decoding for as long as the last recompute took: recomputing takes at most about
        # half the engine's time, and a waiting load waits at most that long (or for the batch's end).
        decoding_since, recompute_cost = time.perf_counter(), 0.0
        step_versions: list[int] = []
        for step in range(n):
            step_versions.append(version)  # the weights that computed `logits`
            tok, lp = _sample(logits, temps, seeds, step)
            out_tokens[rows, step], out_lp[rows, step] = tok, lp
            if k:
                top_lp[rows, step], top_ids[rows, step] = _topk_logprobs(logits, temps, k)
            hit = (tok.unsqueeze(1) == stops).any(1)
            if text_stops:  # only batches with stop strings pay for decoding text
                hit |= _text_stop_hits(self._tokenizer, text_stops, rows, tok, alive & wants_text)
            done = alive & (hit | (budgets <= step + 1))
            lengths[rows[done]] = step + 1
            stopped[rows[done]] = hit[done]
            alive &= ~done
            n_alive = int(alive.sum())
            clock.lap("sample_s")
            if n_alive == 0:
                break
            if 4 * (len(rows) - n_alive) >= len(rows):  # compact: finished rows stop costing compute
                keep = alive.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, temps, seeds, budgets, stops, wants_text, next_pos, mask, tok, alive = (
                    x[keep] for x in (rows, temps, seeds, budgets, stops, wants_text, next_pos, mask, tok, alive))
            if (inflight and (not recompute or time.perf_counter() - decoding_since >= recompute_cost)
                    and (loaded := self._yield_to_loads(adapter)) is not None and loaded != version):
                version = loaded  # the next tokens come from the new weights
                self._stats["inflight_loads"] += 1
                if recompute:  # as if aborted and resubmitted with its prefix:
                    started = time.perf_counter()
                    seq = torch.cat([ids[rows], out_tokens[rows, :step + 1]], dim=1)  # [R, P + step + 1]
                    seq_mask = mask[:, :p + step + 1]
                    cache = self._new_cache(p + n)  # the prefix's KV recomputed under the new weights
                    logits = self._model(input_ids=seq, attention_mask=seq_mask,
                                         position_ids=(seq_mask.cumsum(1) - 1).clamp(min=0), use_cache=True,
                                         logits_to_keep=1, **cache_kwargs(self._model, cache)).logits[:, -1]
                    next_pos = next_pos + 1
                    decoding_since = time.perf_counter()
                    recompute_cost = decoding_since - started
                    self._stats["recompute_s"] += recompute_cost
                    clock.lap("prefill_s")
                    continue
            logits = self._model(input_ids=tok.unsqueeze(1), attention_mask=mask[:, :p + step + 1],
                                 position_ids=next_pos.unsqueeze(1), use_cache=True,
                                 **cache_kwargs(self._model, cache)).logits[:, -1]
            next_pos = next_pos + 1
            clock.lap("forward_s")
        cpu = (lambda x: None if x is None else x.cpu())
        out = (out_tokens.cpu(), out_lp.cpu(), lengths.cpu(), stopped.cpu(), cpu(top_ids), cpu(top_lp), step_versions)
        clock.lap("output_s")
        return out

    def _row_seeds(self, requests: list[GenerationRequest]) -> torch.Tensor:
        """[B] int64: the request's seed, or one drawn from the engine's generator."""
        drawn = torch.randint(0, 1 << 62, (len(requests),), generator=self._generator)
        given = [r.params.seed for r in requests]
        return torch.tensor([_signed64(s) if s is not None else int(d) for s, d in zip(given, drawn)])

    def _new_cache(self, capacity: int) -> DynamicCache:
        cache = DynamicCache(config=self._model.config)
        cache.layers = [_GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
        if not cache.layers and cache.layer_class_to_replicate is DynamicLayer:
            cache.layer_class_to_replicate = lambda: _GrowingLayer(capacity)
        return cache


class _Clock:
    """Adds the wall time since its last lap to a stats counter (`TorchEngine.stats`: prefill_s, forward_s...)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats, self.last = stats, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[name] += now - self.last
        self.last = now


_UNKNOWN = object()  # `_active` after PEFT changed adapters itself: the next batch sets its own


@dataclass(eq=False)
class _Adapter:
    """One LoRA adapter of the engine: its PEFT slot name, its live tensors by saved name, its version."""

    slot: str
    tensors: dict[str, torch.Tensor]
    version: int


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
    for state, t in zip(batch, tok[sel].tolist()):
        state.tokens.append(t)
        tail = state.tokens[-state.window - 1:]
        tails += [tail[:-1], tail]
    texts = tokenizer.batch_decode(tails, skip_special_tokens=False)
    found = [state.completed(before, after) for state, before, after in zip(batch, texts[::2], texts[1::2])]
    hits[sel] = torch.tensor(found, device=hits.device)
    return hits


def _left_padded(prompts: list[tuple[int, ...]], new_tokens: int, device: torch.device):
    """Prompt ids [B, P] left-padded with 0, attention mask [B, P + new_tokens] (0 on padding), prompt lengths [B]."""
    p = max(map(len, prompts))
    ids = torch.tensor([[0] * (p - len(x)) + list(x) for x in prompts], device=device)
    mask = torch.ones(len(prompts), p + new_tokens, dtype=torch.long, device=device)
    mask[:, :p] = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts], device=device)
    return ids, mask, torch.tensor([len(x) for x in prompts], device=device)


def check_prompt(r: GenerationRequest, vocab: int) -> None:
    """A request's prompt is non-empty and inside the vocabulary (every engine checks this at its caller)."""
    if not r.prompt_ids:
        raise ValueError("empty prompt: an engine needs at least one prompt token (prepend a BOS token)")
    if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(r.prompt_ids)}..{max(r.prompt_ids)}")


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a caller's future unless it is already done (failed earlier, or cancelled by its caller)."""
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
