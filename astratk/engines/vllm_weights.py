"""`VLLMEngine`'s weight loads: checking a new state or delta, queueing it for the serving thread, writing it into
vLLM's model (CPU layers re-packed, prefix cache reset), and the host copy of the weights a delta applies to.

`WeightLoads` is a mixin of `VLLMEngine` and works on its state (`_cond`, `_loads`, `_host`, `_version`, ...). A new
kind of load is checked in `_check_update` (caller's thread) and staged in `_stage` (serving thread).
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from astratk.engines import _vllm_compat as compat
from astratk.engines.calls import _settle
from astratk.weights.delta import SparseDelta, apply_delta


@dataclass(eq=False)
class LoadJob:
    """A weight load queued for the serving thread; `future` resolves once it is applied (or failed)."""

    state: Any  # Mapping[str, Tensor] or SparseDelta
    version: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    adapter: str | None = None  # an adapter's load (applied without draining requests)


class WeightLoads:
    """`load_weights` and how the serving thread applies a base-model load (`VLLMEngine`'s module docstring)."""

    def load_weights(self, state: Any, version: int, adapter: str | None = None) -> None:
        """Full/partial state by HF parameter name, or a `SparseDelta` from this engine's version; see the module
        docstring for when it applies. Blocks until applied (at most `load_timeout_s`). With `adapter`: that LoRA
        adapter's tensors (by saved PEFT name) or a delta from its version."""
        if adapter is None:
            self._check_update(state, version)
        else:
            self._adapter(adapter)
        job = LoadJob(state, version, adapter=adapter)
        with self._cond:
            self._check_usable()
            self._loads.append(job)
            self._cond.notify_all()
        try:
            job.future.result(self._load_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"vLLM weight load to version {version} not applied within {self._load_timeout:.0f} s "
                               f"(load_timeout_s): {len(self._running)} requests still in flight") from None

    def _check_update(self, state: Any, version: int) -> None:
        """Refuse, before anything is queued, a load the model cannot take (names, shapes, a delta's versions)."""
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

    def _apply(self, load: LoadJob) -> None:
        """On the serving thread, with no request running: write the load into vLLM, then move to its version."""
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
            counts = self._engine.apply_model(lambda model: load_into(model, tensors, self._cpu))
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

    def _break(self, load: LoadJob, cause: BaseException) -> None:
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


def load_into(model: Any, tensors: Mapping[str, torch.Tensor], cpu: bool) -> int:
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


def read_state(path: str, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name (tied `lm_head.weight` aliased to the embedding, as in `state_dict()`)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _state_files(path):
        state.update(load_file(f))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def state_shapes(path: str, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor shapes by HF name, read without loading the tensors (`keep_host_weights=False`)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in _state_files(path):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes
