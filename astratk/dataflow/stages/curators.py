"""Curators: before rollout, decide which tasks are worth sampling (the first stage point).

All keep their statistics per task id (or per bucket, for the curriculum), so they only matter when tasks come back:
a finite dataset read for several epochs, or a stream that repeats problems. On an endless stream of fresh problems
(the synthetic arithmetic env) a task is almost never seen twice and they accept everything.

| name | rule |
|---|---|
| `accept_all` | submit everything |
| `filter_solved` | per-task EWMA of the success share (decay 0.9, from 0); stop once it reaches 0.95 |
| `greso` | a task whose last z groups had zero reward variance is submitted with prob. max(p_kind^z, floor_kind) |
| `curriculum` | submit buckets (e.g. difficulty levels) whose EWMA pass rate is inside [low, high]; others rarely |
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from astratk.dataflow.stages.base import Curator, rng_state, set_rng_state, success_rate
from astratk.records import Task


class AcceptAll(Curator):
    """Submit every task (AstraFlow's default).

    >>> AcceptAll().should_submit(Task("t", "arithmetic", "1+1="), version=0)
    True
    """

    name = "accept_all"


class FilterSolved(Curator):
    """Stop submitting a task once it is solved: per-task EWMA of the success share, `rate <- decay * rate +
    (1 - decay) * success`, starting at `prior`; submitted while `rate < threshold` (AstraFlow's filter-solved).
    A success is a reward above `success_threshold`. With the defaults (0.9, 0.95, prior 0) the rate crosses 0.95
    after 29 fully solved groups in a row: 1 - 0.9^29 = 0.953 > 0.95 > 1 - 0.9^28 = 0.948.

    >>> c = FilterSolved()
    >>> task = Task("t", "arithmetic", "1+1=")
    >>> for _ in range(29):
    ...     c.update(task, [1.0, 1.0], version=0)
    >>> c.should_submit(task, version=0)
    False
    """

    name = "filter_solved"

    def __init__(self, threshold: float = 0.95, decay: float = 0.9, prior: float = 0.0,
                 success_threshold: float = 0.0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"filter_solved: decay must be in [0, 1), got {decay}")
        self.threshold, self.decay, self.prior = float(threshold), float(decay), float(prior)
        self.success_threshold = float(success_threshold)
        self._rate: dict[str, float] = {}

    def should_submit(self, task: Task, version: int) -> bool:
        return self._rate.get(task.task_id, self.prior) < self.threshold

    def update(self, task: Task, rewards: Sequence[float], version: int) -> None:
        if not rewards:
            return
        prev = self._rate.get(task.task_id, self.prior)
        success = success_rate(rewards, self.success_threshold)
        self._rate[task.task_id] = self.decay * prev + (1.0 - self.decay) * success

    def state_dict(self) -> dict[str, Any]:
        return {"rate": dict(self._rate)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rate = {str(k): float(v) for k, v in state["rate"].items()}

    def metrics(self) -> dict[str, float]:
        return {"tasks_tracked": float(len(self._rate)),
                "tasks_solved": float(sum(r >= self.threshold for r in self._rate.values()))}


class GRESO(Curator):
    """GRESO (arXiv 2506.02177), as AstraFlow implements it: skip tasks that keep producing zero-variance groups.

    Per task, `z` counts the consecutive zero-variance groups (all rewards equal) and their kind: `easy` when the
    mean reward is above `correct_threshold`, else `hard` (a kind flip restarts the streak at 1; a group with
    variance resets it to 0). A task with z = 0 is always submitted; otherwise with probability
    max(p_kind^z, floor_kind), floors 0.10 (easy) / 0.40 (hard). At each new weight version, each p moves by
    `delta_p` toward its target share of zero-variance groups among those seen since the previous version: down
    when the observed share is at or above the target (0.083 easy, 0.167 hard), up otherwise, within [p_min, p_max].
    Difference from AstraFlow: p adapts from the first version on (AstraFlow waits for one dataset epoch; our train
    streams may be endless); the draw is seeded (`seed`) so runs repeat.

    >>> c = GRESO(seed=0)
    >>> task = Task("t", "arithmetic", "1+1=")
    >>> c.update(task, [1.0, 1.0, 1.0], version=0)  # zero variance, all correct: easy streak z = 1
    >>> c.submit_probability(task)
    0.5
    """

    name = "greso"

    def __init__(self, p_easy_init: float = 0.5, p_hard_init: float = 0.5, alpha_easy: float = 0.083,
                 alpha_hard: float = 0.167, delta_p: float = 0.01, p_min: float = 0.01, p_max: float = 0.99,
                 min_submit_easy: float = 0.10, min_submit_hard: float = 0.40, correct_threshold: float = 0.5,
                 seed: int = 0) -> None:
        for key, p in (("p_easy_init", p_easy_init), ("p_hard_init", p_hard_init), ("p_min", p_min),
                       ("p_max", p_max), ("min_submit_easy", min_submit_easy), ("min_submit_hard", min_submit_hard)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"greso: {key} must be a probability in [0, 1], got {p}")
        self.p_easy_init, self.p_hard_init = float(p_easy_init), float(p_hard_init)
        self.alpha_easy, self.alpha_hard, self.delta_p = float(alpha_easy), float(alpha_hard), float(delta_p)
        self.p_min, self.p_max = float(p_min), float(p_max)
        self.min_submit_easy, self.min_submit_hard = float(min_submit_easy), float(min_submit_hard)
        self.correct_threshold, self.seed = float(correct_threshold), int(seed)
        self._p = {"easy": self.p_easy_init, "hard": self.p_hard_init}
        self._streak: dict[str, int] = {}
        self._kind: dict[str, str] = {}  # set while the streak is > 0
        self._window = {"easy": 0, "hard": 0, "total": 0}  # updates since the last version change
        self._last_ratio = {"easy": 0.0, "hard": 0.0}
        self._rng = random.Random(self.seed)

    def submit_probability(self, task: Task) -> float:
        z = self._streak.get(task.task_id, 0)
        if z == 0:
            return 1.0
        kind = self._kind.get(task.task_id, "easy")
        floor = self.min_submit_easy if kind == "easy" else self.min_submit_hard
        return max(self._p[kind] ** z, floor)

    def should_submit(self, task: Task, version: int) -> bool:
        p = self.submit_probability(task)
        return p >= 1.0 or self._rng.random() < p

    def update(self, task: Task, rewards: Sequence[float], version: int) -> None:
        if not rewards:
            return
        qid = task.task_id
        self._window["total"] += 1
        if len(set(rewards)) == 1:  # zero variance (a single sample counts: no signal either)
            kind = "easy" if sum(rewards) / len(rewards) > self.correct_threshold else "hard"
            prev = self._streak.get(qid, 0) if self._kind.get(qid) == kind else 0
            self._streak[qid] = prev + 1
            self._kind[qid] = kind
            self._window[kind] += 1
        else:
            self._streak.pop(qid, None)  # z = 0; dropped rather than stored, so the tables hold streaks only
            self._kind.pop(qid, None)

    def on_version(self, version: int) -> None:
        total = self._window["total"]
        if total:
            for kind, target in (("easy", self.alpha_easy), ("hard", self.alpha_hard)):
                ratio = self._window[kind] / total
                self._last_ratio[kind] = ratio
                step = -self.delta_p if ratio >= target else self.delta_p
                self._p[kind] = min(self.p_max, max(self.p_min, self._p[kind] + step))
        self._window = {"easy": 0, "hard": 0, "total": 0}

    def state_dict(self) -> dict[str, Any]:
        return {"p": dict(self._p), "streak": dict(self._streak), "kind": dict(self._kind),
                "window": dict(self._window), "last_ratio": dict(self._last_ratio), "rng": rng_state(self._rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._p = {k: float(v) for k, v in state["p"].items()}
        self._streak = {str(k): int(v) for k, v in state["streak"].items()}
        self._kind = {str(k): str(v) for k, v in state["kind"].items()}
        self._window = {k: int(v) for k, v in state["window"].items()}
        self._last_ratio = {k: float(v) for k, v in state["last_ratio"].items()}
        set_rng_state(self._rng, state["rng"])

    def metrics(self) -> dict[str, float]:
        return {"p_easy": self._p["easy"], "p_hard": self._p["hard"],
                "observed_easy_ratio": self._last_ratio["easy"], "observed_hard_ratio": self._last_ratio["hard"],
                "tasks_streaking": float(len(self._streak))}


class PassRateCurriculum(Curator):
    """Roll out what is learnable now: tasks whose bucket's pass rate is inside [low, high].

    Tasks are bucketed by `task.info[key]` (e.g. the difficulty `level` of the math envs), or by task id when the
    key is missing. Each bucket keeps an EWMA of its groups' success share (reward above `success_threshold`),
    `rate <- decay * rate + (1 - decay) * success`, starting from the first group's share. An unseen bucket, or one
    inside [low, high], is always submitted; a bucket outside (mastered or hopeless for now) with probability
    `explore`, so its rate keeps being measured and it returns once the policy has moved. Seeded draws (`seed`).

    >>> c = PassRateCurriculum(low=0.2, high=0.8, explore=0.0)
    >>> easy = Task("a", "arithmetic", "1+1=", info={"level": 1})
    >>> c.update(easy, [1.0, 1.0, 1.0, 1.0], version=0)  # level 1 passes 100%: mastered
    >>> c.should_submit(easy, version=0), c.should_submit(Task("b", "arithmetic", "9*9=", info={"level": 5}), 0)
    (False, True)
    """

    name = "curriculum"

    def __init__(self, key: str = "level", low: float = 0.2, high: float = 0.8, decay: float = 0.9,
                 explore: float = 0.1, success_threshold: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"curriculum: need 0 <= low <= high <= 1, got low={low}, high={high}")
        if not 0.0 <= explore <= 1.0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"curriculum: explore must be in [0, 1] and decay in [0, 1), got {explore}, {decay}")
        self.key, self.low, self.high, self.decay = key, float(low), float(high), float(decay)
        self.explore, self.success_threshold, self.seed = float(explore), float(success_threshold), int(seed)
        self._rate: dict[str, float] = {}
        self._rng = random.Random(self.seed)

    def bucket(self, task: Task) -> str:
        return str(task.info.get(self.key, task.task_id))

    def should_submit(self, task: Task, version: int) -> bool:
        rate = self._rate.get(self.bucket(task))
        if rate is None or self.low <= rate <= self.high:
            return True
        return self._rng.random() < self.explore

    def update(self, task: Task, rewards: Sequence[float], version: int) -> None:
        if not rewards:
            return
        b, s = self.bucket(task), success_rate(rewards, self.success_threshold)
        self._rate[b] = s if b not in self._rate else self.decay * self._rate[b] + (1.0 - self.decay) * s

    def state_dict(self) -> dict[str, Any]:
        return {"rate": dict(self._rate), "rng": rng_state(self._rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rate = {str(k): float(v) for k, v in state["rate"].items()}
        set_rng_state(self._rng, state["rng"])

    def metrics(self) -> dict[str, float]:
        inside = sum(self.low <= r <= self.high for r in self._rate.values())
        out = {"buckets": float(len(self._rate)), "buckets_in_zone": float(inside)}
        if len(self._rate) <= 32:  # per-bucket pass rates for a few buckets (levels), not for per-task buckets
            out.update({f"pass_rate_{b.replace('/', '_')}": r for b, r in self._rate.items()})
        return out
