"""Synthetic Python function tasks, generated locally, with hidden unit tests, and the `CodeProblem` record every
code task source (this module, `jsonl`) produces.

A task is a *family* (one function to write, e.g. `keep_greater`) at a *parameter* draw (`k = 7`): the description,
the reference solution and the tests all follow from the pair, so `family(params)` is the task's identity. Hidden test
inputs come from a generator seeded by (seed, identity), and their expected outputs from running the reference
solution here, in-process (it is our code, not the model's). The prompt shows `n_examples` further input/output pairs
that are not among the hidden tests.

| level | families |
|---|---|
| 1 | add_constant, multiply_constant, is_divisible, repeat_string, clamp |
| 2 | count_char, keep_greater, sum_of_multiples, rotate_left, caesar_shift, every_nth |
| 3 | run_length_encode, longest_step_run, digit_power_sum, recurrence_term, top_word, balanced_brackets |

Extending: add a `Family` to `FAMILIES` (name, level, signature, a parameter sampler, a description, the reference
source, and an input sampler). Keep outputs JSON values (int, str, bool, lists): tests compare JSON round-trips.

Example:
    >>> gen = SyntheticTasks(levels=(2,), n_heldout=3, seed=0)
    >>> [p.entry_point for p in gen.heldout()]  # doctest: +SKIP
    ['rotate_left', 'keep_greater', 'caesar_shift']
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Test = dict[str, Any]  # one hidden test, in the harness's schema (env.py): kind "call" | "assert" | "stdio"


@dataclass(frozen=True)
class CodeProblem:
    """One programming problem, whatever its source.

    Tests (hidden from the model), one of three kinds:
      {"kind": "call", "fn": name, "args": [...], "expected": value}  the call's JSON result must equal `expected`;
      {"kind": "assert", "code": src}  `src` runs in the solution's namespace and must not raise;
      {"kind": "stdio", "input": text, "expected": text}  the program, run as __main__ on `input`, prints `expected`.
    """

    problem_id: str
    prompt: str  # the problem statement; the env adds the answer-format instruction
    tests: tuple[Test, ...]
    entry_point: str | None  # the function the tests call; None for stdin/stdout programs
    reference: str | None = None  # a correct solution, when the source has one (demonstrations)
    prefix: str = ""  # code a body-only completion continues (HumanEval's prompt)
    meta: dict[str, Any] = field(default_factory=dict)  # source, level, family, ...


@dataclass(frozen=True)
class Family:
    name: str
    level: int
    signature: str  # "(xs: list[int]) -> list[int]"
    params: Callable[[random.Random], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]  # "returns ..." clause
    source: Callable[[dict[str, Any]], str]  # reference implementation, defines `name`
    inputs: Callable[[random.Random, dict[str, Any]], tuple[Any, ...]]  # one argument tuple


def _ints(rng: random.Random, lo: int = -50, hi: int = 50, max_len: int = 8) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, max_len))]


def _word(rng: random.Random, alphabet: str = string.ascii_lowercase, max_len: int = 10) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def _nonzero(rng: random.Random, lo: int, hi: int) -> int:
    return rng.choice([k for k in range(lo, hi + 1) if k != 0])


_BRACKETS = ["()", "[]", "{}", "<>"]

FAMILIES: tuple[Family, ...] = (
    # --------------------------------------------------------------------------------------------- level 1
    Family("add_constant", 1, "(x: int) -> int",
           lambda r: {"k": _nonzero(r, -99, 99)},
           lambda p: f"returns x plus {p['k']}",
           lambda p: f"def add_constant(x):\n    return x + ({p['k']})\n",
           lambda r, p: (r.randint(-1000, 1000),)),
    Family("multiply_constant", 1, "(x: int) -> int",
           lambda r: {"k": r.choice([k for k in range(-12, 21) if k not in (-1, 0, 1)])},
           lambda p: f"returns x multiplied by {p['k']}",
           lambda p: f"def multiply_constant(x):\n    return x * ({p['k']})\n",
           lambda r, p: (r.randint(-500, 500),)),
    Family("is_divisible", 1, "(n: int) -> bool",
           lambda r: {"k": r.randint(2, 40)},
           lambda p: f"returns True when n is divisible by {p['k']} and False otherwise",
           lambda p: f"def is_divisible(n):\n    return n % {p['k']} == 0\n",
           lambda r, p: (r.choice([p["k"] * r.randint(-20, 20), r.randint(-1000, 1000)]),)),
    Family("repeat_string", 1, "(s: str) -> str",
           lambda r: {"k": r.randint(2, 6), "sep": r.choice(["", "-", " ", ",", "|"])},
           lambda p: f"returns s repeated {p['k']} times, joined by {p['sep']!r}",
           lambda p: f"def repeat_string(s):\n    return {p['sep']!r}.join([s] * {p['k']})\n",
           lambda r, p: (_word(r, max_len=6),)),
    Family("clamp", 1, "(x: int) -> int",
           lambda r: {"lo": r.randint(-60, 0), "hi": r.randint(1, 60)},
           lambda p: f"returns x limited to the range [{p['lo']}, {p['hi']}] (the nearest bound when outside)",
           lambda p: f"def clamp(x):\n    return min(max(x, {p['lo']}), {p['hi']})\n",
           lambda r, p: (r.randint(-100, 100),)),
    # --------------------------------------------------------------------------------------------- level 2
    Family("count_char", 2, "(s: str) -> int",
           lambda r: {"c": r.choice(string.ascii_lowercase), "ci": r.random() < 0.5},
           lambda p: f"returns how many times the letter {p['c']!r} occurs in s"
                     + (", ignoring case" if p["ci"] else " (case-sensitive)"),
           lambda p: ("def count_char(s):\n    return s.lower().count(%r)\n" if p["ci"]
                      else "def count_char(s):\n    return s.count(%r)\n") % p["c"],
           lambda r, p: (_word(r, p["c"] * 3 + p["c"].upper() * 2 + "xyzab", 14),)),
    Family("keep_greater", 2, "(xs: list[int]) -> list[int]",
           lambda r: {"k": r.randint(-20, 20)},
           lambda p: f"returns the elements of xs greater than {p['k']}, in their original order",
           lambda p: f"def keep_greater(xs):\n    return [x for x in xs if x > {p['k']}]\n",
           lambda r, p: (_ints(r),)),
    Family("sum_of_multiples", 2, "(xs: list[int]) -> int",
           lambda r: {"k": r.randint(2, 9)},
           lambda p: f"returns the sum of the elements of xs that are divisible by {p['k']} (0 if none)",
           lambda p: f"def sum_of_multiples(xs):\n    return sum(x for x in xs if x % {p['k']} == 0)\n",
           lambda r, p: (_ints(r, -30, 30, 10),)),
    Family("rotate_left", 2, "(xs: list[int]) -> list[int]",
           lambda r: {"k": r.randint(1, 9)},
           lambda p: f"returns xs rotated left by {p['k']} positions (wrapping around; an empty list stays empty)",
           lambda p: f"def rotate_left(xs):\n    if not xs:\n        return []\n    k = {p['k']} % len(xs)\n"
                     "    return xs[k:] + xs[:k]\n",
           lambda r, p: (_ints(r, 0, 99, 7),)),
    Family("caesar_shift", 2, "(s: str) -> str",
           lambda r: {"k": r.randint(1, 25)},
           lambda p: f"returns s with every lowercase letter shifted {p['k']} places forward in the alphabet "
                     "(wrapping from z to a); other characters unchanged",
           lambda p: f"def caesar_shift(s):\n    return ''.join(chr((ord(c) - 97 + {p['k']}) % 26 + 97) "
                     "if 'a' <= c <= 'z' else c for c in s)\n",
           lambda r, p: (_word(r, string.ascii_lowercase + " .A", 12),)),
    Family("every_nth", 2, "(xs: list[int]) -> list[int]",
           lambda r: {"start": r.randint(0, 3), "step": r.randint(2, 4)},
           lambda p: f"returns the elements of xs at indices {p['start']}, {p['start'] + p['step']}, "
                     f"{p['start'] + 2 * p['step']}, ... (every {p['step']}th element starting at index "
                     f"{p['start']})",
           lambda p: f"def every_nth(xs):\n    return xs[{p['start']}::{p['step']}]\n",
           lambda r, p: (_ints(r, 0, 99, 12),)),
    # --------------------------------------------------------------------------------------------- level 3
    Family("run_length_encode", 3, "(s: str) -> str",
           lambda r: {"sep": r.choice(["", ":", "-"])},
           lambda p: "returns the run-length encoding of s: for each maximal run of one character, the character, "
                     f"then {p['sep']!r}, then the run length, all concatenated (e.g. 'aab' -> "
                     f"'a{p['sep']}2b{p['sep']}1')",
           lambda p: "def run_length_encode(s):\n    out = []\n    i = 0\n    while i < len(s):\n"
                     "        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
                     f"        out.append(s[i] + {p['sep']!r} + str(j - i))\n        i = j\n"
                     "    return ''.join(out)\n",
           lambda r, p: (_word(r, "aaabbc", 12),)),
    Family("longest_step_run", 3, "(xs: list[int]) -> int",
           lambda r: {"d": r.randint(1, 3)},
           lambda p: "returns the length of the longest contiguous run of xs in which every element exceeds the "
                     f"previous one by at least {p['d']} (0 for an empty list, 1 when no pair qualifies)",
           lambda p: "def longest_step_run(xs):\n    best = cur = 0\n    for i, x in enumerate(xs):\n"
                     f"        cur = cur + 1 if i and x - xs[i - 1] >= {p['d']} else 1\n"
                     "        best = max(best, cur)\n    return best\n",
           lambda r, p: (_ints(r, 0, 20, 10),)),
    Family("digit_power_sum", 3, "(n: int) -> int",
           lambda r: {"p": r.randint(1, 5)},
           lambda p: f"returns the sum of the decimal digits of abs(n), each raised to the power {p['p']}",
           lambda p: f"def digit_power_sum(n):\n    return sum(int(c) ** {p['p']} for c in str(abs(n)))\n",
           lambda r, p: (r.randint(-10**6, 10**6),)),
    Family("recurrence_term", 3, "(n: int) -> int",
           lambda r: {"a": r.randint(0, 5), "b": r.randint(0, 5), "p": r.randint(1, 3), "q": r.randint(1, 3)},
           lambda p: f"returns term n (n >= 0) of the sequence t(0) = {p['a']}, t(1) = {p['b']}, "
                     f"t(n) = {p['p']}*t(n-1) + {p['q']}*t(n-2)",
           lambda p: f"def recurrence_term(n):\n    x, y = {p['a']}, {p['b']}\n    for _ in range(n):\n"
                     f"        x, y = y, {p['p']} * y + {p['q']} * x\n    return x\n",
           lambda r, p: (r.randint(0, 25),)),
    Family("top_word", 3, "(s: str) -> str",
           lambda r: {"m": r.randint(1, 4)},
           lambda p: f"returns the most frequent whitespace-separated word of s among words at least {p['m']} "
                     "characters long, breaking ties by choosing the alphabetically smallest; '' if there is none",
           lambda p: "def top_word(s):\n    counts = {}\n    for w in s.split():\n"
                     f"        if len(w) >= {p['m']}:\n            counts[w] = counts.get(w, 0) + 1\n"
                     "    if not counts:\n        return ''\n"
                     "    return min(counts, key=lambda w: (-counts[w], w))\n",
           lambda r, p: (" ".join(r.choice(["a", "to", "the", "cat", "dogs", "apple", "be", "sun"])
                                  for _ in range(r.randint(0, 9))),)),
    Family("balanced_brackets", 3, "(s: str) -> bool",
           lambda r: {"pairs": "".join(sorted(r.sample(_BRACKETS, r.randint(2, 4))))},
           lambda p: "returns True when the brackets in s are balanced and properly nested, for the bracket pairs "
                     + ", ".join(p["pairs"][i:i + 2] for i in range(0, len(p["pairs"]), 2))
                     + " (all other characters are ignored)",
           lambda p: f"def balanced_brackets(s):\n    pairs = {p['pairs']!r}\n"
                     "    close = {pairs[i + 1]: pairs[i] for i in range(0, len(pairs), 2)}\n    stack = []\n"
                     "    for c in s:\n        if c in pairs[0::2]:\n            stack.append(c)\n"
                     "        elif c in close:\n            if not stack or stack.pop() != close[c]:\n"
                     "                return False\n    return not stack\n",
           lambda r, p: (_brackets(r, p["pairs"]),)),
)
LEVELS = sorted({f.level for f in FAMILIES})


def _brackets(rng: random.Random, pairs: str) -> str:
    """Half balanced strings (built by nesting), half random ones, so both answers occur."""
    if rng.random() < 0.5:
        return "".join(rng.choice(pairs + "x") for _ in range(rng.randint(0, 8)))
    out = ""
    for _ in range(rng.randint(0, 4)):
        i = rng.randrange(0, len(pairs), 2)
        out = rng.choice([pairs[i] + out + pairs[i + 1], out + pairs[i] + pairs[i + 1]])
    return out


def _key(family: Family, params: dict[str, Any]) -> str:
    return f"{family.name}({', '.join(f'{k}={v!r}' for k, v in sorted(params.items()))})"


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x))


def build_problem(family: Family, params: dict[str, Any], seed: int, n_tests: int = 5, n_examples: int = 2
                  ) -> CodeProblem:
    """The problem for one (family, params): tests and examples drawn from a generator seeded by its identity."""
    key = _key(family, params)
    source = family.source(params)
    ns: dict[str, Any] = {}
    exec(compile(source, f"<reference {key}>", "exec"), ns)  # noqa: S102 - our own reference code, not the model's
    fn = ns[family.name]
    rng = random.Random(f"{seed}/tests/{key}")
    seen: dict[str, tuple[Any, ...]] = {}
    for _ in range(50 * (n_tests + n_examples)):
        args = family.inputs(rng, params)
        seen.setdefault(json.dumps(args), args)
        if len(seen) == n_tests + n_examples:
            break
    cases = [(list(a), _json(fn(*copy.deepcopy(a)))) for a in seen.values()]
    examples, hidden = cases[:n_examples], cases[n_examples:]
    shown = "\n".join(f"    {family.name}({', '.join(map(repr, a))}) == {e!r}" for a, e in examples)
    prompt = (f"Write a Python function `{family.name}{family.signature}` that {family.describe(params)}.\n\n"
              f"Examples:\n{shown}")
    tests = tuple({"kind": "call", "fn": family.name, "args": _json(a), "expected": e} for a, e in hidden)
    return CodeProblem(problem_id=f"synthetic/L{family.level}/{key}", prompt=prompt, tests=tests,
                       entry_point=family.name, reference=source,
                       meta={"source": "synthetic", "level": family.level, "family": family.name})


class SyntheticTasks:
    """Deterministic problem streams: `heldout()` is a fixed list of `n_heldout` distinct problems; `train()` is an
    endless stream that never yields a held-out one. Both depend only on (levels, seed, n_tests, n_examples)."""

    def __init__(self, levels: Sequence[int] = (1, 2, 3), n_heldout: int = 128, seed: int = 1234, n_tests: int = 5,
                 n_examples: int = 2) -> None:
        unknown = [lv for lv in levels if lv not in LEVELS]
        if not levels or unknown:
            raise ValueError(f"levels must be a non-empty subset of {LEVELS}; got {list(levels)}")
        if n_heldout < 0 or n_tests < 1 or n_examples < 0:
            raise ValueError(f"need n_heldout >= 0, n_tests >= 1, n_examples >= 0; got {n_heldout}, {n_tests}, "
                             f"{n_examples}")
        self.levels = tuple(int(lv) for lv in levels)
        self.seed, self.n_tests, self.n_examples = seed, n_tests, n_examples
        self.families = [f for f in FAMILIES if f.level in self.levels]
        self._heldout = self._draw_heldout(n_heldout)
        self._heldout_ids = {p.problem_id for p in self._heldout}

    def _draw(self, rng: random.Random) -> tuple[Family, dict[str, Any]]:
        family = rng.choice(self.families)
        return family, family.params(rng)

    def _draw_heldout(self, n: int) -> list[CodeProblem]:
        rng = random.Random(f"{self.seed}/heldout")
        keys: dict[str, tuple[Family, dict[str, Any]]] = {}
        for i in itertools.count():
            if len(keys) == n:
                break
            if i > 100 * n:
                raise ValueError(f"levels {self.levels} have too few distinct problems for n_heldout={n}")
            family, params = self._draw(rng)
            keys.setdefault(_key(family, params), (family, params))
        return [build_problem(f, p, self.seed, self.n_tests, self.n_examples) for f, p in keys.values()]

    def heldout(self) -> list[CodeProblem]:
        return list(self._heldout)

    def train(self) -> Iterator[CodeProblem]:
        rng = random.Random(f"{self.seed}/train")
        while True:
            family, params = self._draw(rng)
            problem = build_problem(family, params, self.seed, self.n_tests, self.n_examples)
            if problem.problem_id not in self._heldout_ids:
                yield problem
