"""`MixtureEnv`: train on several envs at once, their tasks interleaved in proportion.

Each source keeps its own tasks, rollout, scoring and grading: the mixture only interleaves task streams and routes
every call to the source named by `task.env`. Sources are named by the keys of `envs`; a task keeps its env name when
it equals its key (the usual case, `{arithmetic: {class_path: arithmetic}, ...}`), and is re-stamped with the key
(env and task id prefixed) otherwise, so two instances of one env class (different levels, say) stay apart.

- train: an endless (or finite, if every source is) deterministic stream, by smooth weighted round-robin: over any
  window of tasks each source's share is within one task of its weight's share. A finished source drops out.
- heldout: every source's held-out list, one after the other (evaluation's accuracy is then their pooled mean).
- roles: every source must play the same roles (in the same order), so policies route identically whatever task
  comes; a union of roles would leave some role groups empty and skew per-role evaluation.

Serving can hold each batch to the same shares with `dataflow.mixing` (by `task.env`; see `astratk.dataflow.stages`).

YAML:

    env:
      class_path: mixture
      init_args:
        envs:
          arithmetic: {class_path: arithmetic, init_args: {levels: [1, 2]}}
          math_word: {class_path: math_word}
        weights: {arithmetic: 3, math_word: 1}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

from astratk.contracts import Engine, Env, SamplingParams
from astratk.records import Task, Trajectory


class MixtureEnv(Env):
    """Example:

    >>> from astratk.envs.math.arithmetic import ArithmeticEnv
    >>> env = MixtureEnv({"easy": ArithmeticEnv(levels=[1]), "hard": ArithmeticEnv(levels=[5])},
    ...                  weights={"easy": 1, "hard": 3})
    >>> [t.env for t, _ in zip(env.tasks("train"), range(8))]
    ['hard', 'easy', 'hard', 'hard', 'hard', 'easy', 'hard', 'hard']
    """

    name = "mixture"

    def __init__(self, envs: dict[str, Env], weights: dict[str, float] | None = None) -> None:
        if not envs:
            raise ValueError("mixture: envs must name at least one env, e.g. {arithmetic: {class_path: arithmetic}}")
        roles = {key: tuple(e.roles) for key, e in envs.items()}
        first = next(iter(roles.values()))
        if any(r != first for r in roles.values()):
            raise ValueError(f"mixture: every env must play the same roles, got {roles}; mix envs of one kind "
                             "(single-turn math, or one workflow over several bases)")
        if weights is not None and (set(weights) != set(envs) or any(not w > 0 for w in weights.values())):
            raise ValueError(f"mixture: weights must give each env in {sorted(envs)} a weight > 0, got {weights}")
        self.envs = dict(envs)
        self.weights = None if weights is None else {k: float(v) for k, v in weights.items()}
        self.roles = first
        self.source_names = tuple(self.envs)  # what `dataflow.mixing.ratios` may name (task.env of every task)

    # ------------------------------------------------------------------------------------------------ tasks
    def _stamp(self, key: str, task: Task) -> Task:
        if task.env == key:
            return task
        return dataclasses.replace(task, env=key, task_id=f"{key}/{task.task_id}")

    def _source(self, task: Task) -> Env:
        try:
            return self.envs[task.env]
        except KeyError:
            raise ValueError(f"mixture: task {task.task_id!r} is from env {task.env!r}, which is not one of its "
                             f"sources {list(self.envs)}") from None

    def tasks(self, split: str) -> Iterable[Task]:
        if split != "train":
            return [self._stamp(key, t) for key, env in self.envs.items() for t in env.tasks(split)]
        return self._interleave()

    def _interleave(self) -> Iterator[Task]:
        weights = self.weights or {k: 1.0 for k in self.envs}
        streams = {k: iter(env.tasks("train")) for k, env in self.envs.items()}
        credit = {k: 0.0 for k in streams}
        while streams:
            total = sum(weights[k] for k in streams)
            for k in streams:
                credit[k] += weights[k] / total
            key = max(streams, key=credit.__getitem__)  # ties: the first listed
            credit[key] -= 1.0
            task = next(streams[key], None)
            if task is None:
                del streams[key]
                continue
            yield self._stamp(key, task)

    # ---------------------------------------------------------------------------------------------- episodes
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        return await self._source(task).rollout(task, engines, sampling, policy_ids=policy_ids, group_id=group_id)

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return self._source(task).score(task, trajectories)

    def score_with_metrics(self, task: Task, trajectories: Sequence[Trajectory]
                           ) -> list[tuple[float | None, dict[str, float]]]:
        return self._source(task).score_with_metrics(task, trajectories)

    def demonstration(self, task: Task) -> str:
        return self._source(task).demonstration(task)

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        return self._source(task).demonstrations(task)

    def messages(self, task: Task) -> list[dict[str, str]]:
        return self._source(task).messages(task)

    def grade(self, task: Task, text: str) -> float:
        return self._source(task).grade(task, text)
