"""Synthetic arithmetic with difficulty levels, a fixed held-out split and an exact-answer grader.

Levels (operands drawn uniformly):

| level | problem | example |
|---|---|---|
| 0 | a + b, a, b < 10 | 3+5= |
| 1 | a + b, a, b < 100 | 37+45= |
| 2 | a + b, a, b < 1000 | 512+389= |
| 3 | a - b, a, b < 1000 (may be negative) | 120-371= |
| 4 | a * b, a < 100, b < 10 | 47*8= |
| 5 | a * b, a, b < 100 | 47*83= |

The held-out split is a fixed list of `n_heldout` problems drawn with the seed; the train stream is endless and never
yields a held-out problem. By default the prompt is terse (`37+45=`) and the reward is 1.0 when the completion,
stripped of surrounding whitespace, equals the answer: the tiny model learns that format in its warm start. A
pretrained chat model answers in sentences ("37 + 45 = 82."), so give it a question (`question: "What is {a} {op}
{b}?"`) and `grading: last_number` (the last integer in the completion is the answer).

Example:
    >>> env = ArithmeticEnv(levels=[1], n_heldout=4, seed=0)
    >>> [t.prompt for t in env.tasks("heldout")]  # doctest: +SKIP
    ['49+97=', ...]
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Mapping, Sequence

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.chat import single_turn
from astratk.envs.math.levelled import LevelledSplits
from astratk.records import Task, Trajectory

LEVELS = {
    0: ("+", 10, 10),
    1: ("+", 100, 100),
    2: ("+", 1000, 1000),
    3: ("-", 1000, 1000),
    4: ("*", 100, 10),
    5: ("*", 100, 100),
}


def _exact(text: str, answer: str) -> float:
    return 1.0 if text.strip() == answer else 0.0


def _last_number(text: str, answer: str) -> float:
    """1.0 when the last integer in `text` (thousands separators allowed) is the answer."""
    found = re.findall(r"-?\d[\d,]*", text)
    return 1.0 if found and found[-1].replace(",", "").rstrip(",") == answer else 0.0


GRADINGS = {"exact": _exact, "last_number": _last_number}


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithmeticEnv(LevelledSplits, Env):
    """Single-turn arithmetic: one role, `policy`, answers `a<op>b=` with the number."""

    name = "arithmetic"
    roles = ("policy",)

    def __init__(self, levels: Sequence[int] = (1, 2), n_heldout: int = 512, seed: int = 1234,
                 system_prompt: str | None = None, question: str | None = None, grading: str = "exact") -> None:
        """`question`: the prompt as a format string of {a}, {op}, {b} (None: "{a}{op}{b}="); `grading`: exact (the
        stripped completion is the answer) or last_number (its last integer is)."""
        if grading not in GRADINGS:
            raise ValueError(f"grading: unknown {grading!r}; choose one of {sorted(GRADINGS)}")
        if question is not None:
            try:
                question.format(a=1, op="+", b=2)
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"question: {question!r} must be a format string of {{a}}, {{op}} and {{b}} ({e})"
                                 ) from None
        self.system_prompt, self.question, self.grading = system_prompt, question, grading
        self._init_splits(levels, LEVELS, n_heldout, seed)

    # --------------------------------------------------------------------------------------------------- tasks
    def _problem(self, rng: random.Random, split: str, index: int) -> Task:
        level = self.levels[index % len(self.levels)]
        op, hi_a, hi_b = LEVELS[level]
        a, b = rng.randrange(hi_a), rng.randrange(hi_b)
        prompt = f"{a}{op}{b}=" if self.question is None else self.question.format(a=a, op=op, b=b)
        return Task(task_id=f"{self.name}/{split}/L{level}/{prompt}", env=self.name, prompt=prompt,
                    info={"answer": str(_answer(a, op, b)), "level": level}, split=split)  # type: ignore[arg-type]

    def demonstration(self, task: Task) -> str:
        return str(task.info["answer"])

    # ------------------------------------------------------------------------------------------------- rollout
    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": task.prompt}]

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        return [await single_turn(engines["policy"], self.messages(task), sampling, task=task, group_id=group_id,
                                  policy_id=policy_ids["policy"])]

    # --------------------------------------------------------------------------------------------------- score
    def grade(self, task: Task, text: str) -> float:
        return GRADINGS[self.grading](text, str(task.info["answer"]))

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [self.grade(task, t.text) for t in trajectories]


def run_episode(env: Env, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[Trajectory]:
    """Convenience for notebooks and tests: one episode, synchronously."""
    return asyncio.run(env.rollout(task, engines, sampling, policy_ids={r: r for r in env.roles}, group_id="g0"))
