"""`VLLMEngine`'s serving thread: it starts vLLM, admits queued requests into the running batch, steps the engine
and turns vLLM's outputs into `Completion`s (tokens, processed log-probs, top-K, one version per completion).

`ServingLoop` is a mixin of `VLLMEngine` and works on its state (`_cond`, `_pending`, `_loads`, `_running`, ...).
What a request asks of vLLM is set in `_add`; what a finished one returns, in `_finish` and `_take_tokens`.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion
from astratk.engines import _vllm_compat as compat
from astratk.engines.calls import _Call, _settle


@dataclass(eq=False)
class Running:
    """One request inside vLLM: its call, index, and what has been generated so far."""

    call: _Call
    index: int
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[tuple[int, ...]] = field(default_factory=list)
    topk_lp: list[tuple[float, ...]] = field(default_factory=list)
    lora_id: int = 0  # the LoRARequest id it runs with (0: none)


class ServingLoop:
    """The serving thread's loop (`_serve`), from vLLM's start-up to its shutdown (`VLLMEngine`'s module docstring,
    "Process model")."""

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
        self._running[rid] = Running(call, i, version, lora_id=0 if adapter is None else lora.lora_int_id)
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
            _take_tokens(run, out.outputs[0])
            if out.finished:
                self._finish(out, run)

    def _finish(self, out: Any, run: Running) -> None:
        """A request vLLM finished: its completion into its call (settled once all of the call's are in)."""
        c = out.outputs[0]
        del self._running[out.request_id]
        if run.lora_id and run.lora_id in self._lora_dirs:
            self._retire_loras()
        self._stats["tokens"] += len(run.tokens)
        self._stats["cached_tokens"] += out.num_cached_tokens or 0
        if c.finish_reason not in ("stop", "length"):
            self._fail_call(run.call, RuntimeError(f"vLLM ended request with {c.finish_reason!r}"))
            return
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


def _take_tokens(run: Running, c: Any) -> None:
    """Append a step's new tokens of one request (vLLM's DELTA output `c`) with their log-probs and, when the request
    asked for K, the K best alternatives by vLLM's rank (NaN where vLLM gave no log-prob for the sampled token)."""
    k = run.call.requests[run.index].params.top_k_logprobs
    for tok, lps in zip(c.token_ids, c.logprobs or [{}] * len(c.token_ids), strict=True):
        run.tokens.append(tok)
        run.logprobs.append(lps[tok].logprob if tok in lps else float("nan"))
        if k:
            best = sorted((v.rank, t, v.logprob) for t, v in lps.items() if v.rank is not None and v.rank <= k)
            run.topk_ids.append(tuple(t for _, t, _ in best[:k]))
            run.topk_lp.append(tuple(lp for _, _, lp in best[:k]))
