"""Code solver + test-case generator (AstraFlow's multi-policy code workflow).

One episode: the test generator reads the problem and writes `n_tests` assert statements; the solver writes the
code. Both are single turns and independent, so they are generated concurrently. Scoring runs over the whole lease
(every episode's trajectories of both roles, `Env.score` across roles), because a generated test is only worth
something if it separates right from wrong solutions in the solver's group:

- solver: the fraction of the problem's hidden tests its code passes (as `CodeEnv`);
- test generator: the fraction of its `n_tests` tests that are valid (the reference solution passes them) and that
  reject at least one wrong solution from the group (a solver's code that fails some hidden test); a missing or
  unparsable test counts as not valid. No wrong solution in the group: no test can earn its reward (0).

Sandbox cost per lease: one run per distinct solver program (hidden tests), one run of the reference against every
distinct generated test, and one run per distinct wrong program against the valid generated tests.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.chat import single_turn
from astratk.envs.code.env import CodeEnv, solution_code
from astratk.records import Task, Trajectory

_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def parse_asserts(text: str, limit: int) -> list[str]:
    """Up to `limit` distinct one-line `assert` statements from the text (inside its first ```python block when it has
    one), each of which parses as Python."""
    m = _BLOCK.search(text)
    body = m.group(1) if m else text
    out: list[str] = []
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("assert ") or line in out:
            continue
        try:
            ast.parse(line)
        except SyntaxError:
            continue
        out.append(line)
        if len(out) == limit:
            break
    return out


class SolverTestGenEnv(Env):
    """Solver + test generator over a `CodeEnv` whose problems have a reference solution and an entry point."""

    name = "solver_testgen"
    roles = ("solver", "test_generator")

    def __init__(self, base: CodeEnv | None = None, n_tests: int = 2,
                 generator_prompt: str = "{problem}\n\nDo not solve it. Write {n} assert statements that test "
                                         "`{entry}` on inputs of your choice, in one ```python code block.") -> None:
        self.base = base if base is not None else CodeEnv(levels=(1,), n_heldout=64)
        if not isinstance(self.base, CodeEnv):
            raise TypeError(f"base must be a CodeEnv, got {type(self.base).__name__}")
        if n_tests < 1:
            raise ValueError(f"n_tests must be >= 1, got {n_tests}")
        self.n_tests, self.generator_prompt = n_tests, generator_prompt

    # ------------------------------------------------------------------------------------------------ tasks
    def tasks(self, split: str) -> Iterable[Task]:
        return (t for t in self.base.tasks(split) if t.info.get("entry_point"))

    def messages(self, task: Task) -> list[dict[str, str]]:
        return self.base.messages(task)

    def demonstration(self, task: Task) -> str:
        return self.base.demonstration(task)

    def grade(self, task: Task, text: str) -> float:
        return self.base.grade(task, text)

    def generator_messages(self, task: Task) -> list[dict[str, str]]:
        prompt = self.generator_prompt.format(problem=task.prompt, n=self.n_tests, entry=task.info["entry_point"])
        return [{"role": "user", "content": prompt}]

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """The reference solution, and `n_tests` asserts built from the hidden `call` tests."""
        asserts = [f"assert {t['fn']}(*{t['args']!r}) == {t['expected']!r}" for t in task.info["tests"]
                   if t.get("kind") == "call"][: self.n_tests]
        out = [(self.messages(task), self.demonstration(task))]
        if asserts:
            out.append((self.generator_messages(task), "```python\n" + "\n".join(asserts) + "\n```"))
        return out

    # ------------------------------------------------------------------------------------------------ rollout
    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        solver, generator = await asyncio.gather(
            single_turn(engines["solver"], self.messages(task), sampling, task=task, group_id=group_id,
                        policy_id=policy_ids["solver"], role="solver"),
            single_turn(engines["test_generator"], self.generator_messages(task), sampling, task=task,
                        group_id=group_id, policy_id=policy_ids["test_generator"], role="test_generator",
                        seed_salt=104729))
        written = float(len(parse_asserts(generator.text, self.n_tests)))
        return [solver, dataclasses.replace(generator, metrics={**generator.metrics, "tests_written": written})]

    # ------------------------------------------------------------------------------------------------ score
    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [r for r, _ in self.score_with_metrics(task, trajectories)]

    def score_with_metrics(self, task: Task, trajectories: Sequence[Trajectory]
                           ) -> list[tuple[float | None, dict[str, float]]]:
        """Rewards per role as in the module docstring, with sandbox metrics for solvers and, for generators, how
        many of their tests were valid and how many rejected a wrong solution."""
        for t in trajectories:
            if t.role not in self.roles:
                raise ValueError(f"{self.name}: unknown role {t.role!r} in trajectory {t.group_id}")
        solvers = [t for t in trajectories if t.role == "solver"]
        solved = dict(zip((id(t) for t in solvers), self.base.score_details(task, [t.text for t in solvers]),
                          strict=True))
        entry, prefix = task.info.get("entry_point"), task.info.get("prefix", "")
        wrong = sorted({code for t in solvers
                        if (code := solution_code(t.text, entry, prefix)) is not None
                        and solved[id(t)].reward is not None and solved[id(t)].reward < 1.0})
        generated = {id(t): parse_asserts(t.text, self.n_tests) for t in trajectories if t.role == "test_generator"}
        distinct = sorted({a for tests in generated.values() for a in tests})
        valid, rejecting = self._judge_tests(task, distinct, wrong)
        out: list[tuple[float | None, dict[str, float]]] = []
        for t in trajectories:
            if t.role == "solver":
                s = solved[id(t)]
                out.append((s.reward, dict(s.metrics)))
                continue
            tests = generated[id(t)]
            if valid is None:  # no reference solution (or its sandbox run failed): cannot judge
                out.append((None, {"tests_written": float(len(tests))}))
                continue
            good = [a for a in tests if valid.get(a) and rejecting.get(a)]
            out.append((len(good) / self.n_tests, {
                "tests_written": float(len(tests)), "tests_valid": float(sum(bool(valid.get(a)) for a in tests)),
                "tests_rejecting": float(len(good)), "wrong_solutions_in_group": float(len(wrong))}))
        return out

    def _judge_tests(self, task: Task, tests: list[str], wrong: list[str]
                     ) -> tuple[dict[str, bool] | None, dict[str, bool]]:
        """(valid per test: the reference passes it, or None when it cannot be judged; rejects some wrong program)."""
        if not task.info.get("reference"):
            return None, {}
        if not tests:
            return {}, {}
        reference = solution_code(self.base.demonstration(task), task.info.get("entry_point"),
                                  task.info.get("prefix", ""))
        as_tests = [{"kind": "assert", "code": a} for a in tests]
        ref = self.base.run_tests(reference, as_tests)
        if ref.reward is None:
            return None, {}
        valid = dict(zip(tests, ref.per_test, strict=True))
        kept = [a for a in tests if valid[a]]
        rejecting = dict.fromkeys(tests, False)
        if kept and wrong:
            checks = [{"kind": "assert", "code": a} for a in kept]
            with ThreadPoolExecutor(max_workers=max(1, min(len(wrong), self.base.max_parallel or 4))) as pool:
                for result in pool.map(lambda code: self.base.run_tests(code, checks), wrong):
                    if result.reward is None:  # that program's sandbox failed: it proves nothing either way
                        continue
                    for a, ok in zip(kept, result.per_test, strict=True):
                        rejecting[a] = rejecting[a] or not ok
        return valid, rejecting
