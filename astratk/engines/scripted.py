"""`ScriptedEngine`: a deterministic `Engine` for tests. It returns scripted tokens instantly, with fixed log-probs.

Why it exists: envs, rollout services and the data path are tested against it on a laptop CPU in
milliseconds, with completions chosen by the test rather than by a random model.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from astratk.contracts import Completion, GenerationRequest, SamplingParams, expand_samples, fit_context

Script = Callable[[tuple[int, ...], SamplingParams], Sequence[int]] | Sequence[Sequence[int]]


class ScriptedEngine:
    """Completions from a script: `script(prompt_ids, params) -> token ids`, or a list of token lists used in turn.

    The first argument is the engine's tokenizer (envs encode prompts with `engine.tokenizer`), None, or a model
    directory whose tokenizer is loaded (None if it has none): a run built from a spec with `rollout.engine: scripted`
    passes the policy's model directory there, as to every engine, and `rollout.engine_args` give the script.

    A completion is cut after its first stop token, then to `max_tokens`; `finish_reason` is "stop" when its last
    token is one of the request's stop tokens, else "length". Every token gets log-prob `logprob` and the engine's
    current version. `load_weights` only records what it was given (`loads`: (version, sorted names) per call).
    `max_model_len` (None: no limit) gives the engine a context length, fitted as real engines fit it
    (`fit_context`: the budget cut to the room left, `PromptTooLong` when there is none).

    Example:
        >>> engine = ScriptedEngine(None, [[5, 6, 7]])
        >>> import asyncio
        >>> [c] = asyncio.run(engine.generate([GenerationRequest((1, 2), SamplingParams(stop_token_ids=(6,)))]))
        >>> c.token_ids, c.finish_reason
        ((5, 6), 'stop')
    """

    def __init__(self, tokenizer: Any = None, script: Script = ((0,),), *, logprob: float = math.log(0.5),
                 version: int = 0, max_model_len: int | None = None, delay_s: float = 0.0) -> None:
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = _tokenizer_of(os.fspath(tokenizer))
        if callable(script):
            self._script = script
        else:
            outputs = [tuple(tokens) for tokens in script]
            if not outputs:
                raise ValueError("script is an empty list; give at least one token list, or a callable")
            turns, lock = itertools.cycle(outputs), threading.Lock()

            def cycled(prompt_ids: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
                with lock:  # calls may come from several threads
                    return next(turns)

            self._script = cycled
        self._tokenizer = tokenizer
        self._logprob = float(logprob)
        self._version = version
        self.max_model_len = max_model_len
        self.delay_s = float(delay_s)  # each generate call first waits this long (a slow engine, for timeouts)
        self.loads: list[tuple[int, tuple[str, ...]]] = []
        self.requests: list[GenerationRequest] = []  # every request seen, in order (for assertions)

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return [self._complete(fit_context(r, self.max_model_len)) for r in expand_samples(requests)]

    def load_weights(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        names = state.changes if hasattr(state, "changes") else state  # a SparseDelta: the names it changes
        self.loads.append((version, tuple(sorted(names))))
        self._version = version

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"ScriptedEngine(version={self._version}, requests={len(self.requests)})"

    def _complete(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        params = request.params
        tokens = [int(t) for t in self._script(tuple(request.prompt_ids), params)]
        if not tokens:
            raise ValueError(f"script returned no tokens for prompt {request.prompt_ids[:8]}...; an engine always "
                             "produces at least one")
        stops = set(params.stop_token_ids)
        first_stop = next((i for i, t in enumerate(tokens) if t in stops), None)
        if first_stop is not None:
            tokens = tokens[: first_stop + 1]
        tokens = tokens[: params.max_tokens]
        n = len(tokens)
        return Completion(tuple(tokens), (self._logprob,) * n, (self._version,) * n,
                          "stop" if tokens[-1] in stops else "length")


def _tokenizer_of(model_dir: str) -> Any:
    """The tokenizer saved in `model_dir`, or None when it holds none (as `TorchEngine` loads it)."""
    from astratk.engines.torch_engine import _TOKENIZER_FILES

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"ScriptedEngine: {model_dir!r} is not a model directory; give the engine a model "
                                "directory (its tokenizer is loaded), a tokenizer object, or None")
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    from astratk.models.loading import load_tokenizer

    return load_tokenizer(model_dir)
