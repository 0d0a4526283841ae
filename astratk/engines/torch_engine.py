"""`TorchEngine`: the built-in engine. An HF-transformers causal LM, a KV cache, batched sampling, a request batcher.

This module builds the engine and holds its `Engine` contract; each part of its work has a module of its own.

Batching (`torch_batching`). Episodes call `generate` concurrently (asyncio tasks in one loop, other threads, other
loops). A call queues its requests and gets a `concurrent.futures.Future` (`asyncio.wrap_future` makes it awaitable in
the caller's loop). One worker thread takes the first queued request, then waits while more keep arriving: until none
has arrived for `batch_window_s` (at most `BATCH_WAIT_MAX_S` in all, or until `max_batch`), runs them as one batch and
resolves the callers' futures; a call larger than `max_batch` spans batches. A lone request waits `batch_window_s`
only. An exception in a batch goes to the calls in that batch, and the worker carries on.

Decoding (`torch_decode`, `torch_kvcache`, `torch_sampling`). Prompts are left-padded, position ids count each row's
real tokens; one prefill (equal prompts, such as a group's samples, once each), then one token per step through the KV
cache (`astratk.models.kvcache`). A row stops at one of its `stop_token_ids` (kept in the completion) or at its
`max_tokens`; rows with different temperatures, budgets and stops share a batch, and finished rows are compacted away
once they are a quarter of it. Stop strings (`params.stop`, needs a tokenizer) end a row at the token whose text
completes one, kept too: only rows that have them decode, each step, a short tail of their generated tokens
(`_text_stop_hits`). Sampling is inverse-CDF on softmax(logits / T), no top-k / top-p (so r = 1 on-policy); T = 0 is
greedy, scored with the untempered softmax. Behaviour log-probs come from `logprobs_from_logits`, the trainer's formula.

Prefix cache (`torch_prefix_cache`). The K/V of each finished sequence (prompt and generated tokens) are kept across
batches within `prefix_cache_mb` (`enable_prefix_caching`, vLLM's key, turns it off). A prompt that shares at least
`MIN_REUSE` tokens with a kept sequence (an agent's next turn, which extends its last one; a new episode, which shares
its system message and tools) starts from those K/V and prefills only the rest. Rows compute what they would alone.

Devices and memory. `device` (auto, cpu, cuda, cuda:N) and `dtype` (auto, float32, bfloat16, float16,
bfloat16-if-native) come from `rollout.engine_args`; auto is the GPU in bf16 when torch sees one (`astratk.gpu`), else
the CPU in fp32; bfloat16-if-native is bf16 on a CPU with bf16 units too. Everything a
batch computes (ids, masks, the KV cache, seeds, samples) lives on the model's device; results come back to the CPU
once per batch. `gpu_memory_utilization` (vLLM's name and meaning: this engine's fraction of the GPU's memory) caps
this process's CUDA allocator at that share and cuts batches so that the weights, the KV cache and the activations
fit (`astratk.engines.memory`); the engine prints what the budget allows when it starts.

Seeds. Random numbers are a counter-based hash of (row seed, token index), so a request with `params.seed` gets the
same completion whatever shares its batch; unseeded rows draw a seed from the engine's generator (`seed=`). Equal
seeds and prompts give equal completions: give each episode of a group its own seed, or none.

Weights and versions (`torch_weights`). `load_weights` copies tensors into the parameters under the lock a running
batch holds, so a batch in flight finishes on the weights it started with and every token of a completion carries that
batch's version. A load drops the prefix cache's entries computed under the old weights (an adapter's load, that
adapter's), so nothing computed under old weights outlives it, and it waits for at most the batch in flight. A `SparseDelta` is written in place under the same lock, and only onto
the version it was made from (`base_version` must equal the engine's version when the lock is taken; otherwise the load
fails and changes nothing, and the caller fetches a full state). Both kinds check names and shapes before the first
write. With `weight_updates` `inflight` or `inflight_recompute` a load waiting for the lock runs between two decode
steps instead, and the tokens after it carry the new version.

LoRA adapters (`torch_lora`). `add_adapter(name, lora, state, version)` attaches a PEFT LoRA adapter to the model (the
base is held once, however many adapters) and returns its `AdapterView` (`astratk.engines.adapters`), whose requests
name the adapter. With `mix_adapters` (the default; weight_updates between_requests) requests of every adapter and of
the base share a batch: one base forward for all rows, each adapter's LoRA matmuls on its own rows, as multi-LoRA
servers do (`torch_lora_mix`; plain LoRA on linear layers, other adapters batch alone). Otherwise a batch runs rows of
one adapter: the batcher takes the oldest queued request's adapter and the queued requests of that adapter, so each
adapter keeps its requests' order and none waits behind more than the batches ahead of it. An adapter's `load_weights`
(its tensors by saved PEFT name, or a `SparseDelta` from its version) takes the same lock, so the guarantees above
hold per adapter and every token carries the version of its adapter. An engine without adapters runs exactly as
before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from astratk.contracts import Completion, GenerationRequest, expand_samples, fit_context
from astratk.engines.adapters import AdapterView
from astratk.engines.calls import _Call, check_prompt
from astratk.engines.memory import MARGIN, MemoryBudget, model_budget
from astratk.engines.torch_batching import Batcher
from astratk.engines.torch_decode import completions, decode
from astratk.engines.torch_kvcache import _GQA_ATTENTION
from astratk.engines.torch_lora import EngineAdapters
from astratk.engines.torch_lora_mix import MixedLora, order
from astratk.engines.torch_prefix_cache import PrefixCache
from astratk.engines.torch_sampling import _row_seeds
from astratk.engines.torch_weights import WEIGHT_UPDATES, WeightLoads, check_load
from astratk.gpu import check_fraction, reserve_memory, resolve_device, resolve_dtype
from astratk.models.loading import load_causal_lm, load_tokenizer
from astratk.weights.delta import SparseDelta

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


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
                 batch_window_s: float = 0.002, seed: int = 0, weight_updates: str = "between_requests",
                 enable_prefix_caching: bool = True, prefix_cache_mb: float = 1024, mix_adapters: bool = True) -> None:
        # keys as a run config names them (rollout.engine_args), where these arguments come from
        device = resolve_device(device, "rollout.engine_args.device")
        dtype = resolve_dtype(dtype, device, "rollout.engine_args.dtype")
        check_fraction(gpu_memory_utilization, "rollout.engine_args.gpu_memory_utilization")
        path = os.fspath(model_path)
        model = load_causal_lm(str(path), _DTYPES[dtype], device)
        has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)
        tokenizer = load_tokenizer(path) if has_tokenizer else None  # checked to round-trip text
        self._setup(model, tokenizer, max_batch=max_batch, version=version, batch_window_s=batch_window_s, seed=seed,
                    gpu_memory_utilization=gpu_memory_utilization, weight_updates=weight_updates,
                    prefix_cache_mb=prefix_cache_mb if enable_prefix_caching else 0, mix_adapters=mix_adapters)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, *, max_batch: int = 512, version: int = 0,
                   batch_window_s: float = 0.002, seed: int = 0, gpu_memory_utilization: float | None = None,
                   weight_updates: str = "between_requests", enable_prefix_caching: bool = True,
                   prefix_cache_mb: float = 1024, mix_adapters: bool = True) -> TorchEngine:
        """Serve an in-memory model (on its current device and dtype). The engine puts it in eval mode and, on CPU
        with sdpa attention, switches it to the grouped-K/V variant `_sdpa_gqa` (same outputs, faster decode)."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, max_batch=max_batch, version=version, batch_window_s=batch_window_s, seed=seed,
                    gpu_memory_utilization=check_fraction(gpu_memory_utilization,
                                                          "rollout.engine_args.gpu_memory_utilization"),
                    weight_updates=weight_updates, prefix_cache_mb=prefix_cache_mb if enable_prefix_caching else 0,
                    mix_adapters=mix_adapters)
        return self

    def _setup(self, model: torch.nn.Module, tokenizer: Any, *, max_batch: int, version: int,
               batch_window_s: float, seed: int, gpu_memory_utilization: float | None = None,
               weight_updates: str = "between_requests", prefix_cache_mb: float = 0, mix_adapters: bool = False
               ) -> None:
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
        self._max_batch, self._version = max_batch, version
        self._generator = torch.Generator().manual_seed(seed)
        self._loads = WeightLoads()  # the weights lock, held by a running batch and by load_weights
        self._stats = {"batches": 0, "requests": 0, "tokens": 0, "max_batch_seen": 0, "errors": 0,
                       "budget_capped_batches": 0, "inflight_loads": 0, "recompute_s": 0.0,
                       "prefill_s": 0.0, "forward_s": 0.0, "sample_s": 0.0, "output_s": 0.0, "prefix_s": 0.0,
                       "mixed_batches": 0}
        self._batcher = Batcher(max_batch=max_batch, window_s=batch_window_s, loads=self._loads, run=self._run_batch,
                                fits=self._fits, stop=self.close, stats=self._stats, mixes=self._mixes)
        self._memory, self._release_memory = self._budget(gpu_memory_utilization)
        self._prefix = self._prefix_cache(prefix_cache_mb)
        self._adapters = EngineAdapters(model, self._params, self._loads.lock)  # LoRA adapters (module docstring)
        # batches that mix adapters (`torch_lora_mix`): only where no weights load between decode steps
        self._mix = MixedLora(model) if mix_adapters and weight_updates == "between_requests" else None

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
        out = dict(self._stats)
        if self._prefix is not None:
            out.update(self._prefix.stats, prefix_entries=self._prefix.entries, prefix_bytes=self._prefix.bytes)
        return out

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

    def _prefix_cache(self, megabytes: float) -> PrefixCache | None:
        """The prefix cache (`torch_prefix_cache`): `prefix_cache_mb` MiB, within a GPU budget at most a quarter of
        what the weights leave (taken from the batches' share); None when 0 or `enable_prefix_caching` is off."""
        if megabytes < 0:
            raise ValueError(f"rollout.engine_args.prefix_cache_mb must be >= 0 (0: off), got {megabytes}")
        nbytes = int(megabytes * 2**20)
        if self._memory is not None:
            nbytes = min(nbytes, max(0, self._memory.free_bytes) // 4)
            self._memory = dataclasses.replace(self._memory, weight_bytes=self._memory.weight_bytes + nbytes)
        return PrefixCache(nbytes) if nbytes else None

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
            self._adapters.get(adapter)
        for r in call.requests:
            self._validate(r)
        if not call.requests:
            call.future.set_result([])
            return call.future
        self._batcher.put(call)
        return call.future

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        return await asyncio.wrap_future(self.submit(requests))

    def load_weights(self, state: Mapping[str, torch.Tensor] | SparseDelta, version: int,
                     adapter: str | None = None) -> None:
        """Copy `state` (any subset of the model's parameter names) into the model, or write a `SparseDelta` made
        from the engine's current version into it; applied between batches (in-flight modes: between decode steps).
        With `adapter`, the same for that LoRA adapter's tensors (by saved PEFT name) and version."""
        slot = None if adapter is None else self._adapters.get(adapter)
        params = self._params if slot is None else slot.tensors
        check_load(state, version, params)
        with self._loads.turn():
            current = self._version if slot is None else slot.version
            self._loads.write(params, state, version, current)
            if slot is None:
                self._version = version
            else:
                slot.version = version
            if self._prefix is not None:  # entries computed with the old tensors are stale
                self._prefix.drop(None if slot is None else (lambda tag: tag[0] != adapter))

    @property
    def broken(self) -> RuntimeError | None:
        """Why the engine refuses work (a full load failed half-way: its weights are neither version), or None. The
        rollout service replaces a broken engine at its next sync."""
        return self._loads.broken

    # ------------------------------------------------------------------------------------------------ adapters
    def add_adapter(self, name: str, lora: Any, state: Mapping[str, torch.Tensor], version: int) -> Any:
        """Attach LoRA adapter `name` (`lora`: its `LoraSpec`) with tensors `state` (by saved PEFT name, as the
        trainer publishes them) at `version`; returns its `AdapterView`. Waits for the batch in flight."""
        self._adapters.add(name, lora, state, version)
        return AdapterView(self, name)

    def adapter(self, name: str) -> Any:
        """The `AdapterView` of adapter `name`."""
        self._adapters.get(name)
        return AdapterView(self, name)

    def adapter_version(self, name: str) -> int:
        return self._adapters.get(name).version

    @property
    def adapters(self) -> list[str]:
        """The names of the attached LoRA adapters."""
        return list(self._adapters.slots)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker after its current batch; queued calls fail with RuntimeError."""
        try:
            self._batcher.close(timeout_s)
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

    # ------------------------------------------------------------------------------------------------ batches
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

    def _mixes(self, a: str | None, b: str | None) -> bool:
        """Whether rows of adapters `a` and `b` (None: the base) may share a batch (`mix_adapters`)."""
        if a == b:
            return True
        return self._mix is not None and all(x is None or self._adapters.get(x).mixable for x in (a, b))

    def _run_batch(self, requests: list[GenerationRequest], adapters: list[str | None]) -> list[Completion]:
        """Decode one batch (the batcher's worker) under the weights lock: each row with its adapter (one adapter
        applied to the whole model, or rows of several adapters over one base forward: `torch_lora_mix`)."""
        mixed = len(set(adapters)) > 1
        rows = order(adapters) if mixed else list(range(len(requests)))
        requests, adapters = [requests[i] for i in rows], [adapters[i] for i in rows]
        with self._loads.lock, torch.inference_mode():
            if mixed:
                self._adapters.activate(None, self._version)  # every LoRA layer computes its base; hooks add the rest
                versions = [self._version if a is None else self._adapters.get(a).version for a in adapters]
            else:
                adapter = adapters[0]
                version = self._adapters.activate(adapter, self._version) if self._adapters else self._version
                versions = [version] * len(requests)
            seeds = _row_seeds(requests, self._generator).to(self._device)  # [B]
            decoded = decode(self._model, self._tokenizer, requests, seeds, versions[0], device=self._device,
                             stats=self._stats, weight_updates=self.weight_updates,
                             take_loads=lambda: self._yield_to_loads(adapters[0]), prefix_cache=self._prefix,
                             tags=[(a, v, self._version) for a, v in zip(adapters, versions, strict=True)],
                             mix=self._mix if mixed else None,
                             slots=[None if a is None else self._adapters.get(a).slot for a in adapters])
        started = time.perf_counter()
        out = completions(requests, decoded, versions if mixed else None)
        s = self._stats
        s.update(batches=s["batches"] + 1, requests=s["requests"] + len(requests),
                 tokens=s["tokens"] + sum(len(c.token_ids) for c in out),
                 max_batch_seen=max(s["max_batch_seen"], len(requests)), mixed_batches=s["mixed_batches"] + mixed,
                 output_s=s["output_s"] + time.perf_counter() - started)
        back = [None] * len(out)  # the caller's order
        for j, i in enumerate(rows):
            back[i] = out[j]
        return back

    def _yield_to_loads(self, adapter: str | None) -> int | None:
        """In-flight mode, between two decode steps, under the weights lock: let waiting `load_weights` calls run
        (the batch's KV cache is kept), then take the lock back; returns the version now served, or None when no load
        was waiting."""
        if not self._loads.yield_to_waiting():
            return None
        if adapter is not None:
            self._adapters.forget_active()  # a load may have re-activated nothing; make the next line re-apply it
            return self._adapters.activate(adapter, self._version)
        return self._version
