"""Math problems from JSONL files a user supplies (GSM8K, MATH, or a generic layout), graded by `MathGrader`.

One JSON object per line (blank lines are allowed); the format is given or detected from the file's first row:

| format | keys | gold answer |
|---|---|---|
| `gsm8k` | `question`, `answer` | the text after the last `####` in `answer` (`... #### 42`) |
| `math` | `problem`, `solution` | the last `\\boxed{...}` in `solution` (nested braces kept), else the row's `answer` |
| `generic` | `prompt`, `answer` | `answer` (a string or a number) |

A malformed file is rejected whole with a `ValueError` naming the file, the 1-based line and what is wrong (bad JSON,
not an object, a missing or empty key, no extractable answer): no row is ever skipped silently. Paths may be any
fsspec URL (local, `memory://`, object stores).

The user message is the problem followed by `instruction` (by default: reason step by step and put the final answer
within `\\boxed{}`); the demonstration is `\\boxed{answer}`. Train rows whose problem text is also a held-out problem
are left out of the train stream so the splits stay disjoint; `stats` counts them and a warning says so. The train
stream is endless: the train rows in a new seeded order each epoch.

Example:
    >>> env = MathJsonlEnv("data/gsm8k_train.jsonl", "data/gsm8k_test.jsonl")  # doctest: +SKIP
    >>> env.stats  # doctest: +SKIP
    {'train': 7473, 'heldout': 1319, 'train_overlap_removed': 0}
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from astratk.contracts import split_tasks
from astratk.envs.jsonl import records
from astratk.envs.math.grading import MathGrader, last_boxed
from astratk.envs.math.word import SingleTurnMathEnv
from astratk.records import Task

FORMATS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution"), "generic": ("prompt", "answer")}
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class MathExample:
    prompt: str  # the problem text
    answer: str  # the gold final answer
    solution: str  # the reference solution when the file has one (GSM8K's answer, MATH's solution), else ""
    line: int  # 1-based line in the file


def _detect(row: dict[str, Any]) -> str | None:
    for fmt in ("math", "gsm8k", "generic"):  # MATH-500 rows also carry 'answer': test 'math' first
        if all(k in row for k in FORMATS[fmt]):
            return fmt
    return None


def _text(row: dict[str, Any], key: str, allow_number: bool = False) -> str:
    value = row.get(key)
    if allow_number and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if key not in row:
        raise ValueError(f"missing key {key!r} (keys: {sorted(row)})")
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string{' or a number' if allow_number else ''}, got "  # noqa: TRY004
                         f"{type(value).__name__}")  # (a malformed file is a ValueError: the loader's contract)
    if not value.strip():
        raise ValueError(f"{key!r} is empty")
    return value


def _example(row: dict[str, Any], fmt: str, line: int) -> MathExample:
    """One row in format `fmt`; raises ValueError saying what is wrong (the caller adds file and line)."""
    if fmt == "gsm8k":
        question, answer = _text(row, "question"), _text(row, "answer")
        if "####" not in answer:
            raise ValueError("no extractable answer: 'answer' has no '#### <final answer>' marker")
        gold = answer.rsplit("####", 1)[1].strip()
        if not gold:
            raise ValueError("no extractable answer: nothing after '####' in 'answer'")
        return MathExample(question.strip(), gold, answer, line)
    if fmt == "math":
        problem, solution = _text(row, "problem"), _text(row, "solution")
        gold = last_boxed(solution)
        if not gold and "answer" in row:
            gold = _text(row, "answer", allow_number=True).strip()
        if not gold:
            raise ValueError("no extractable answer: 'solution' has no complete non-empty \\boxed{...} and the row "
                             "has no 'answer'")
        return MathExample(problem.strip(), gold, solution, line)
    prompt, answer = _text(row, "prompt"), _text(row, "answer", allow_number=True)
    return MathExample(prompt.strip(), answer.strip(), "", line)


def load_math_jsonl(path: str, format: str = "auto") -> list[MathExample]:
    """Every row of a GSM8K / MATH / generic JSONL file (module docstring), or a ValueError naming file and line."""
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose 'auto' or one of {sorted(FORMATS)}")
    fmt = None if format == "auto" else format
    rows: list[MathExample] = []
    for line, row in records(path):
        where = f"{path}:{line}"
        if fmt is None:
            fmt = _detect(row)
            if fmt is None:
                raise ValueError(f"{where}: cannot tell the format from keys {sorted(row)}; expected "
                                 + ", ".join(f"{n} {list(k)}" for n, k in FORMATS.items()) + " (or pass format=...)")
        try:
            rows.append(_example(row, fmt, line))
        except ValueError as e:
            raise ValueError(f"{where}: {e} (format {fmt!r})") from None
    if not rows:
        raise ValueError(f"{path}: no rows (the file is empty); expected one JSON object per line")
    return rows


class MathJsonlEnv(SingleTurnMathEnv):
    """Single-turn math on user JSONL files: `train_path` streams train tasks, `heldout_path` is the held-out list.

    Example:
        >>> env = MathJsonlEnv("train.jsonl", "test.jsonl", format="gsm8k")  # doctest: +SKIP
        >>> task = next(iter(env.tasks("heldout")))  # doctest: +SKIP
        >>> env.grade(task, "... so the answer is \\\\boxed{18}")  # doctest: +SKIP
        1.0
    """

    name = "math_jsonl"

    def __init__(self, train_path: str, heldout_path: str, format: str = "auto",
                 instruction: str | None = DEFAULT_INSTRUCTION, system_prompt: str | None = None, seed: int = 0,
                 grading_timeout_s: float = 5.0) -> None:
        self.train_path = train_path
        self.heldout_path = heldout_path
        self.format = format
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.seed = seed
        self.grading_timeout_s = grading_timeout_s
        self.grader = MathGrader(timeout_s=grading_timeout_s)
        heldout = load_math_jsonl(heldout_path, format)
        train = load_math_jsonl(train_path, format)
        self._heldout = [self._task(x, "heldout") for x in heldout]
        keys = {x.prompt for x in heldout}
        self._train = [self._task(x, "train") for x in train if x.prompt not in keys]
        self.stats = {"train": len(self._train), "heldout": len(self._heldout),
                      "train_overlap_removed": len(train) - len(self._train)}
        if not self._train:
            raise ValueError(f"every problem in {train_path} is also in {heldout_path}; no train tasks remain")
        if self.stats["train_overlap_removed"]:
            warnings.warn(f"{self.stats['train_overlap_removed']} problems of {train_path} are also in "
                          f"{heldout_path}; they are left out of the train stream", stacklevel=2)

    def _task(self, x: MathExample, split: str) -> Task:
        return Task(task_id=f"{self.name}/{split}/{x.line}", env=self.name, prompt=x.prompt,
                    info={"answer": x.answer, "line": x.line}, split=split)  # type: ignore[arg-type]

    def tasks(self, split: str) -> Iterator[Task]:
        return split_tasks(split, self._heldout, self._train_stream)

    def _train_stream(self) -> Iterator[Task]:
        for epoch in itertools.count():
            order = list(self._train)
            random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
            yield from order

    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = super().messages(task)
        if self.instruction:
            msgs[-1] = {"role": "user", "content": f"{task.prompt}\n\n{self.instruction}"}
        return msgs

    def demonstration(self, task: Task) -> str:
        return f"\\boxed{{{task.info['answer']}}}"
