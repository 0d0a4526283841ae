"""Synthetic arithmetic with difficulty levels, a fixed held-out split and an exact-answer grader.

Levels (operands drawn uniformly):

| level | problem | example |
|---|---|---|
| 1 | a + b, a, b < 100 | 37+45= |
| 2 | a + b, a, b < 1000 | 512+389= |
| 3 | a - b, a, b < 1000 (may be negative) | 120-371= |
| 4 | a * b, a < 100, b < 10 | 47*8= |
| 5 | a * b, a, b < 100 | 47*83= |

The held-out split is a fixed list of `n_heldout` problems drawn with the seed; the train stream is endless and never
yields a held-out problem. Reward is 1.0 when the completion, stripped of surrounding whitespace, equals the answer.

Example:
    >>> env = ArithmeticEnv(levels=[1], n_heldout=4, seed=0)
    >>> [t.prompt for t in env.tasks("heldout")]  # doctest: +SKIP
    ['49+97=', ...]
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator, Mapping, Sequence

from astratk.contracts import Engine, Env, GenerationRequest, SamplingParams
from astratk.envs.chat import encode_chat, stop_token_ids
from astratk.records import Task, Trajectory

LEVELS = {
    1: ("+", 100, 100),
    2: ("+", 1000, 1000),
    3: ("-", 1000, 1000),
    4: ("*", 100, 10),
    5: ("*", 100, 100),
}


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithmeticEnv(Env):
    """Single-turn arithmetic: one role, `policy`, answers `a<op>b=` with the number."""

    name = "arithmetic"
    roles = ("policy",)

    def __init__(self, levels: Sequence[int] = (1, 2), n_heldout: int = 512, seed: int = 1234,
                 system_prompt: str | None = None) -> None:
        unknown = [lv for lv in levels if lv not in LEVELS]
        if not levels or unknown:
            raise ValueError(f"levels must be a non-empty subset of {sorted(LEVELS)}; got {list(levels)}")
        if n_heldout < 1:
            raise ValueError(f"n_heldout must be >= 1, got {n_heldout}")
        self.levels = tuple(int(lv) for lv in levels)
        self.n_heldout = n_heldout
        self.seed = seed
        self.system_prompt = system_prompt
        self._heldout = self._draw_heldout()
        self._heldout_keys = {t.prompt for t in self._heldout}

    # --------------------------------------------------------------------------------------------------- tasks
    def _problem(self, rng: random.Random, split: str, index: int) -> Task:
        level = self.levels[index % len(self.levels)]
        op, hi_a, hi_b = LEVELS[level]
        a, b = rng.randrange(hi_a), rng.randrange(hi_b)
        prompt = f"{a}{op}{b}="
        return Task(task_id=f"{self.name}/{split}/L{level}/{prompt}", env=self.name, prompt=prompt,
                    info={"answer": str(_answer(a, op, b)), "level": level}, split=split)  # type: ignore[arg-type]

    def _draw_heldout(self) -> list[Task]:
        rng = random.Random(f"{self.seed}/heldout")
        tasks: dict[str, Task] = {}
        for i in itertools.count():
            if len(tasks) == self.n_heldout:
                break
            if i > 100 * self.n_heldout:
                raise ValueError(f"levels {self.levels} have too few distinct problems for n_heldout="
                                 f"{self.n_heldout}")
            t = self._problem(rng, "heldout", i)
            tasks.setdefault(t.prompt, t)
        return list(tasks.values())

    def tasks(self, split: str) -> Iterator[Task]:
        if split == "heldout":
            return iter(self._heldout)
        if split != "train":
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
        return self._train_stream()

    def _train_stream(self) -> Iterator[Task]:
        rng = random.Random(f"{self.seed}/train")
        for i in itertools.count():
            t = self._problem(rng, "train", i)
            if t.prompt not in self._heldout_keys:
                yield t

    def demonstration(self, task: Task) -> str:
        return str(task.info["answer"])

    # ------------------------------------------------------------------------------------------------- rollout
    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": task.prompt}]

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        engine = engines["policy"]
        tok = engine.tokenizer
        prompt = encode_chat(tok, self.messages(task))
        params = SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                                stop_token_ids=stop_token_ids(tok), seed=sampling.seed,
                                top_k_logprobs=sampling.top_k_logprobs)
        [c] = await engine.generate([GenerationRequest(tuple(prompt), params)])
        text = tok.decode(list(c.token_ids), skip_special_tokens=True)
        n = len(c.token_ids)
        return [Trajectory(task_id=task.task_id, group_id=group_id, policy_id=policy_ids["policy"], role="policy",
                           tokens=tuple(prompt) + c.token_ids, n_prompt=len(prompt), loss_mask=(1,) * n,
                           behavior_logprobs=c.logprobs, behavior_versions=c.versions,
                           finished=c.finish_reason == "stop", text=text,
                           metrics={"completion_tokens": float(n)}, behavior_topk_ids=c.topk_ids,
                           behavior_topk_logprobs=c.topk_logprobs)]

    # --------------------------------------------------------------------------------------------------- score
    def grade(self, task: Task, text: str) -> float:
        return 1.0 if text.strip() == str(task.info["answer"]) else 0.0

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [self.grade(task, t.text) for t in trajectories]


def run_episode(env: Env, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[Trajectory]:
    """Convenience for notebooks and tests: one episode, synchronously."""
    return asyncio.run(env.rollout(task, engines, sampling, policy_ids={r: r for r in env.roles}, group_id="g0"))
