"""Frozen models in an episode: the engines of the roles a `FrozenSpec` plays, with its own sampling and a count of
what the episode asked of them.

A frozen model (a simulated user, an opponent, a judge an env asks in its episodes) is served by the rollout worker
beside the policies and never trained. An episode reaches it through the same `Engine` contract as a policy's
engine, wrapped here once per episode (`FrozenCalls`), so that:
- its own `temperature` applies whatever the env asks (a greedy simulated user beside a sampled policy), and its
  `max_new_tokens` caps each reply (an env's smaller budget, e.g. the room left in its context, still holds), and
- each episode's calls are counted apart from the policy's: `frozen/<name>/calls` (replies generated),
  `frozen/<name>/tokens` (tokens in them) and `frozen/<name>/seconds` (time the episode waited for them), in the
  metrics of every trajectory of the episode. The data layer averages them per policy and role like any trajectory
  metric, and counts the frozen role's own trajectories apart (`data/frozen/<name>/...`): they are never trained on.

Example:
    >>> import asyncio
    >>> from astratk.contracts import GenerationRequest, SamplingParams
    >>> from astratk.engines.scripted import ScriptedEngine
    >>> user = FrozenCalls(ScriptedEngine(None, [[5, 6, 7]]), "user", temperature=0.0)
    >>> [c] = asyncio.run(user.generate([GenerationRequest((1, 2), SamplingParams(temperature=1.0, max_tokens=8))]))
    >>> {k: v for k, v in user.metrics().items() if not k.endswith("seconds")}
    {'frozen/user/calls': 1.0, 'frozen/user/tokens': 3.0}
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from astratk.contracts import Completion, GenerationRequest
from astratk.records import Trajectory


class FrozenCalls:
    """`engine` (a frozen model's, for one episode) with `temperature` set and `max_new_tokens` capping every
    request when given, and the episode's calls counted (`metrics()`). Everything else is the engine's."""

    def __init__(self, engine: Any, name: str, *, temperature: float | None = None,
                 max_new_tokens: int | None = None) -> None:
        self._engine, self.name = engine, name
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.calls = self.tokens = 0
        self.seconds = 0.0

    def _params(self, request: GenerationRequest) -> GenerationRequest:
        p = request.params
        if self.temperature is not None:
            p = dataclasses.replace(p, temperature=float(self.temperature))
        if self.max_new_tokens is not None and self.max_new_tokens < p.max_tokens:  # never past the room asked for
            p = dataclasses.replace(p, max_tokens=self.max_new_tokens)
        return request if p is request.params else dataclasses.replace(request, params=p)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        start = time.perf_counter()
        try:
            out = await self._engine.generate([self._params(r) for r in requests])
        finally:
            self.seconds += time.perf_counter() - start
        self.calls += len(out)
        self.tokens += sum(len(c.token_ids) for c in out)
        return out

    def metrics(self) -> dict[str, float]:
        key = f"frozen/{self.name}/"
        return {key + "calls": float(self.calls), key + "tokens": float(self.tokens), key + "seconds": self.seconds}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def frozen_engines(engines: Mapping[str, Any], routes: Mapping[str, str], spec: Any
                   ) -> tuple[dict[str, Any], list[FrozenCalls]]:
    """One episode's engines: each role a frozen model plays gets a fresh `FrozenCalls` (one per model, shared by
    its roles); the others are as given. Returns them and the counters."""
    counters: dict[str, FrozenCalls] = {}
    out = dict(engines)
    for role, name in routes.items():
        f = spec.frozen_model(name)
        if f is None:
            continue
        if name not in counters:
            counters[name] = FrozenCalls(engines[role], name, temperature=f.temperature,
                                         max_new_tokens=f.max_new_tokens)
        out[role] = counters[name]
    return out, list(counters.values())


def with_counts(trajectories: Sequence[Trajectory], counters: Sequence[FrozenCalls]) -> list[Trajectory]:
    """The episode's trajectories with its frozen models' counts in their metrics."""
    if not counters:
        return list(trajectories)
    counts = {k: v for c in counters for k, v in c.metrics().items()}
    return [dataclasses.replace(t, metrics={**t.metrics, **counts}) for t in trajectories]
