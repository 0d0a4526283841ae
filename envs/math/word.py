"""Synthetic word problems with difficulty levels, a fixed held-out split, and `MathGrader` rewards.

Levels (several templates each; names, items and numbers drawn with the seed; every answer a whole number):

| level | steps | templates |
|---|---|---|
| 1 | one: + or - | buy more, give away, put together |
| 2 | one: * or / | unit price, equal sharing, speed x time, packs |
| 3 | two | change from a bill, buy then share, two legs of a trip, bake then sell |
| 4 | multi-step | two-item basket then change, pooled sharing with a remainder, wages less spending, trip with a rest |
| 5 | fractions and percents | a discount, a fraction of a whole, a percent of a group |

Prompts stay under ~190 characters so the built-in tiny model (256 positions, one token per character) sees the whole
problem with room for the answer. The held-out split is a fixed list of `n_heldout` problems drawn with the seed; the
endless train stream never yields a held-out prompt. The demonstration is the bare number, which the grader accepts
(its last-number rule), so the tiny model can be warm-started on it; larger models may box their answer instead.

Extending: add a template function `(rng) -> (text, answer)` to a level's list in `TEMPLATES`; it must return a whole
number and should keep the text short.

Example:
    >>> env = WordProblemEnv(levels=[1], n_heldout=4, seed=0)
    >>> task = next(iter(env.tasks("heldout")))
    >>> env.grade(task, env.demonstration(task))
    1.0
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.chat import single_turn
from astratk.envs.math.grading import OUTCOMES, MathGrader
from astratk.envs.math.levelled import LevelledSplits
from astratk.records import Task, Trajectory

NAMES = ("Ann", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jay", "Kim", "Leo", "Mia", "Noor")
ITEMS = ("apples", "pens", "stickers", "marbles", "cards", "books", "shells", "cookies", "eggs", "buttons")
VEHICLES = ("car", "bus", "train", "bike", "boat")

Template = Callable[[random.Random], tuple[str, int]]


def _two_names(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    return a, b


# ----------------------------------------------------------------------------------------- level 1: + or -
def _buy_more(rng: random.Random) -> tuple[str, int]:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randrange(2, 50), rng.randrange(2, 50)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b


def _give_away(rng: random.Random) -> tuple[str, int]:
    (name, friend), item = _two_names(rng), rng.choice(ITEMS)
    a = rng.randrange(10, 60)
    b = rng.randrange(1, a)
    return f"{name} had {a} {item} and gave {b} to {friend}. How many {item} does {name} have left?", a - b


def _together(rng: random.Random) -> tuple[str, int]:
    (name, friend), item = _two_names(rng), rng.choice(ITEMS)
    a, b = rng.randrange(2, 50), rng.randrange(2, 50)
    return f"{name} has {a} {item} and {friend} has {b}. How many {item} do they have together?", a + b


# ----------------------------------------------------------------------------------------- level 2: * or /
def _unit_price(rng: random.Random) -> tuple[str, int]:
    item, p, n = rng.choice(ITEMS), rng.randrange(2, 13), rng.randrange(2, 13)
    return f"One of the {item} costs ${p}. How many dollars do {n} of them cost?", p * n


def _share(rng: random.Random) -> tuple[str, int]:
    name, item, each, k = rng.choice(NAMES), rng.choice(ITEMS), rng.randrange(2, 13), rng.randrange(2, 10)
    return f"{name} shares {each * k} {item} equally among {k} friends. How many does each friend get?", each


def _speed(rng: random.Random) -> tuple[str, int]:
    v, s, h = rng.choice(VEHICLES), rng.randrange(2, 13) * 5, rng.randrange(2, 9)
    return f"A {v} goes {s} km each hour. How many km does it go in {h} hours?", s * h


def _packs(rng: random.Random) -> tuple[str, int]:
    name, item, n, k = rng.choice(NAMES), rng.choice(ITEMS), rng.randrange(2, 10), rng.randrange(2, 13)
    return f"{name} buys {n} packs of {item} with {k} in each pack. How many {item} is that?", n * k


# ----------------------------------------------------------------------------------------- level 3: two steps
def _change(rng: random.Random) -> tuple[str, int]:
    name, item, n, p = rng.choice(NAMES), rng.choice(ITEMS), rng.randrange(2, 8), rng.randrange(2, 10)
    bill = next(b for b in (10, 20, 50, 100) if b >= n * p)
    text = (f"{name} buys {n} {item} at ${p} each and pays with a ${bill} bill. How many dollars of change does "
            f"{name} get?")
    return text, bill - n * p


def _buy_then_share(rng: random.Random) -> tuple[str, int]:
    name, item, k, each = rng.choice(NAMES), rng.choice(ITEMS), rng.randrange(2, 7), rng.randrange(2, 10)
    a = rng.randrange(1, k * each)
    text = (f"{name} has {a} {item}, buys {k * each - a} more, then shares them equally among {k} friends. How many "
            "does each friend get?")
    return text, each


def _two_legs(rng: random.Random) -> tuple[str, int]:
    v, s1, h1, s2, h2 = (rng.choice(VEHICLES), rng.randrange(2, 13) * 5, rng.randrange(1, 5),
                         rng.randrange(2, 13) * 5, rng.randrange(1, 5))
    return (f"A {v} goes {s1} km/h for {h1} hours, then {s2} km/h for {h2} hours. How many km does it go in all?",
            s1 * h1 + s2 * h2)


def _bake_and_sell(rng: random.Random) -> tuple[str, int]:
    name, n, k = rng.choice(NAMES), rng.randrange(2, 7), rng.randrange(6, 13)
    sold = rng.randrange(1, n * k)
    return f"{name} bakes {n} trays of {k} cookies and sells {sold}. How many cookies are left?", n * k - sold


# ----------------------------------------------------------------------------------------- level 4: multi-step
def _basket(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    x, y = rng.sample(ITEMS, 2)
    a, p, b, q = rng.randrange(2, 6), rng.randrange(2, 9), rng.randrange(2, 6), rng.randrange(2, 9)
    bill = next(v for v in (20, 50, 100) if v >= a * p + b * q)
    text = (f"{name} buys {a} {x} at ${p} each and {b} {y} at ${q} each, paying with ${bill}. How many dollars of "
            "change?")
    return text, bill - a * p - b * q


def _pool_and_share(rng: random.Random) -> tuple[str, int]:
    (name, friend), item = _two_names(rng), rng.choice(ITEMS)
    k, each = rng.randrange(3, 8), rng.randrange(2, 9)
    rest = rng.randrange(1, k)
    a = rng.randrange(1, k * each + rest)
    text = (f"{name} has {a} {item} and {friend} has {k * each + rest - a}. They share them equally among {k} kids "
            "and keep the rest. How many does each kid get?")
    return text, each


def _wages(rng: random.Random) -> tuple[str, int]:
    name, w, h, d = rng.choice(NAMES), rng.randrange(8, 21), rng.randrange(2, 9), rng.randrange(2, 6)
    spent = rng.randrange(1, w * h * d)
    text = (f"{name} earns ${w} an hour, works {h} hours a day for {d} days, then spends ${spent}. How many dollars "
            "are left?")
    return text, w * h * d - spent


def _trip_time(rng: random.Random) -> tuple[str, int]:
    v, s, t, rest = rng.choice(VEHICLES), rng.randrange(4, 13) * 10, rng.randrange(2, 7), rng.randrange(1, 4)
    text = (f"A {v} travels {s * t} km at {s} km per hour and stops to rest for {rest} hours. How many hours does "
            "the trip take?")
    return text, t + rest


# ----------------------------------------------------------------------------------------- level 5: parts
def _discount(rng: random.Random) -> tuple[str, int]:
    item, pct = rng.choice(ITEMS), rng.choice((10, 20, 25, 50))
    price = {10: 10, 20: 5, 25: 4, 50: 2}[pct] * rng.randrange(2, 40)  # so the sale price is whole
    return (f"A box of {item} costs ${price}. It is {pct}% off today. What is the sale price in dollars?",
            price * (100 - pct) // 100)


def _fraction_of(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    num, den = rng.choice(((1, 2), (1, 3), (2, 3), (1, 4), (3, 4), (2, 5)))
    total = den * rng.randrange(2, 15)
    return (f"{name} has {total} {item} and gives away {num}/{den} of them. How many {item} does {name} keep?",
            total - total * num // den)


def _percent_of(rng: random.Random) -> tuple[str, int]:
    pct, n = rng.choice((10, 20, 25, 30, 40, 50, 60, 75)), rng.randrange(1, 9) * 20
    return f"A class has {n} pupils and {pct}% of them walk to school. How many pupils walk to school?", n * pct // 100


TEMPLATES: dict[int, tuple[Template, ...]] = {
    1: (_buy_more, _give_away, _together),
    2: (_unit_price, _share, _speed, _packs),
    3: (_change, _buy_then_share, _two_legs, _bake_and_sell),
    4: (_basket, _pool_and_share, _wages, _trip_time),
    5: (_discount, _fraction_of, _percent_of),
}


# ------------------------------------------------------------------------------------------------- envs
class SingleTurnMathEnv(Env):
    """One role, `policy`, answers `task.prompt` in one completion; `MathGrader` scores it against
    `task.info["answer"]`. Subclasses provide `tasks` (and may extend `messages`); the attributes `system_prompt`
    and `grader` must be set by their constructors."""

    roles = ("policy",)
    system_prompt: str | None = None
    grader: MathGrader

    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": task.prompt}]

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        return [await single_turn(engines["policy"], self.messages(task), sampling, task=task, group_id=group_id,
                                  policy_id=policy_ids["policy"])]

    def demonstration(self, task: Task) -> str:
        return str(task.info["answer"])

    def grade(self, task: Task, text: str) -> float:
        return self.grader.grade(str(task.info["answer"]), text)

    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [r for r, _ in self.score_with_metrics(task, trajectories)]

    def score_with_metrics(self, task: Task, trajectories: Sequence[Trajectory]
                           ) -> list[tuple[float | None, dict[str, float]]]:
        """Rewards, and per trajectory 0/1 flags for how grading ended, so timeouts, missing answers and exact-match
        fallbacks show in the run's metrics (`math/timeout`, `math/no_answer`, `math/exact_fallback`,
        `math/child_error`) rather than only in the grader's per-process counters."""
        out: list[tuple[float | None, dict[str, float]]] = []
        for t in trajectories:
            reward, outcome = self.grader.grade_outcome(str(task.info["answer"]), t.text)
            out.append((reward, {f"math/{k}": float(outcome == k) for k in OUTCOMES if k != "verified"}))
        return out


class WordProblemEnv(LevelledSplits, SingleTurnMathEnv):
    """Single-turn synthetic word problems (module docstring); reward from `MathGrader`, timeout `grading_timeout_s`.

    Example:
        >>> env = WordProblemEnv(levels=[1, 3], n_heldout=64, seed=7)
        >>> train = list(itertools.islice(env.tasks("train"), 3))  # deterministic per seed
    """

    name = "math_word"

    def __init__(self, levels: Sequence[int] = (1, 2), n_heldout: int = 512, seed: int = 1234,
                 system_prompt: str | None = None, grading_timeout_s: float = 5.0) -> None:
        self.system_prompt = system_prompt
        self.grading_timeout_s = grading_timeout_s
        self.grader = MathGrader(timeout_s=grading_timeout_s)
        self._init_splits(levels, TEMPLATES, n_heldout, seed)

    def _problem(self, rng: random.Random, split: str, index: int) -> Task:
        level = self.levels[index % len(self.levels)]
        template = rng.choice(TEMPLATES[level])
        prompt, answer = template(rng)
        digest = hashlib.sha1(prompt.encode()).hexdigest()[:12]
        return Task(task_id=f"{self.name}/{split}/L{level}/{digest}", env=self.name, prompt=prompt,
                    info={"answer": str(answer), "level": level, "template": template.__name__.lstrip("_")},
                    split=split)  # type: ignore[arg-type]

