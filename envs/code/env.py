"""Single-turn code env: the policy writes a Python function (or program) in a ```python block; `score` runs the
problem's hidden tests on it in a `Sandbox`; reward = fraction of tests passed.

One sandbox run per distinct completion: a harness (`HARNESS`, below) loads the solution once, runs each test under
its own try/except and SIGALRM time budget, and prints one JSON line per test as it finishes (so tests that passed
before a hang still count). The harness never sees expected values of `call` and `stdio` tests: it reports what the
code returned or printed and the comparison happens here, so a program cannot read the answers it is graded against.
`assert` tests (HumanEval, MBPP) carry their expected values as code, unavoidably. Result lines carry a per-run random
tag and each test may report once; a program that forges or repeats lines scores 0 (`code/tampered`). The limit of
this: the program runs in the harness's interpreter, so one written to dig the tag out of the harness's frames (gc,
`sys._getframe`) could forge results; that takes deliberate code, visible in the completion, and nothing outside the
sandbox is reachable either way.

Rewards come from `score` (the contract returns rewards only); `score_details` returns them with per-trajectory
metrics, for callers that record them. Extending: another problem source only has to produce `tasks.CodeProblem`s.

Scoring metrics (`score_details`, and `CodeScore.metrics`): tests passed/total, timeouts, errors, whether code was
found, the isolation used (`code/isolation_bwrap` 1.0 or 0.0; `CodeScore.isolation` has the name), whether the run had
a uid of its own (`code/own_uid`), a cgroup capping its total memory and process count (`code/cgroup`), private temp
dirs and IPC (`code/own_mounts`: nothing it left in /tmp, /var/tmp, /dev/shm outlives it), no socket reaching outside
it (`code/own_network`: own network namespace, no host Unix socket reachable), whether the run was killed at its
memory or output cap, sandbox seconds. A sandbox that failed before the harness started (a broken install, not the
program) gives reward None, which the rollout service counts and drops.

Example:
    >>> env = CodeEnv(levels=(1,), n_heldout=2, seed=0)
    >>> task = next(iter(env.tasks("heldout")))
    >>> env.grade(task, env.demonstration(task))  # doctest: +SKIP
    1.0
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import itertools
import json
import math
import os
import random
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.chat import single_turn
from astratk.envs.code.execute import SandboxResult
from astratk.envs.code.jsonl import Format, load_problems
from astratk.envs.code.sandbox import Isolation, Sandbox
from astratk.envs.code.tasks import CodeProblem, SyntheticTasks
from astratk.records import Task, Trajectory

INLINE_BYTES = 65536  # results longer than this come back as a SHA-256 of their canonical form (exact match only)
CAPTURE_BYTES = 16 << 20  # most printed output one stdio test may produce (more is read as a truncated answer)


def normalize_output(text: str) -> str:
    """Printed output as compared: trailing whitespace of each line and trailing blank lines ignored."""
    return "\n".join(line.rstrip() for line in text.rstrip().split("\n"))


# The harness runs inside the sandbox as main.py; the spec (solution code, tests without expected values, budget,
# tag) arrives on stdin, which it then closes. Standard fds 0/1/2 point at /dev/null except while a stdio test runs
# (then at that test's input and output files), so a program's own prints can neither flood nor forge the result
# channel, a private duplicate of the original stdout.
HARNESS = r'''
import io, json, os, signal, sys, time  # hashlib and tempfile load only when needed: startup is per run

class _Timeout(BaseException):  # BaseException: `except Exception` in the program cannot swallow it
    pass

def _alarm(signum, frame):
    raise _Timeout()

''' + inspect.getsource(normalize_output) + r'''
def _encode(text, normalize):
    if len(text) <= SPEC["inline"]:
        return {"text": text}
    import hashlib
    return {"sha": hashlib.sha256(normalize(text).encode("utf-8", "replace")).hexdigest(), "len": len(text)}

def _stdio(code, data, null):
    # the test's input and output are files on fds 0 and 1, so input(), sys.stdin.buffer, open(0) and os.write(1)
    # all work as they would in a terminal
    import tempfile
    with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout:
        fin.write(data.encode()); fin.flush(); fin.seek(0)
        os.dup2(fin.fileno(), 0); os.dup2(fout.fileno(), 1)
        saved = sys.stdin, sys.stdout
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        finally:
            try:
                sys.stdout.flush()
            finally:
                sys.stdin, sys.stdout = saved
                os.dup2(null, 0); os.dup2(null, 1)
        fout.seek(0)
        return fout.read(SPEC["capture"] + 1).decode("utf-8", "replace")

def _find(ns, name):
    if name in ns:
        return ns[name]
    if "Solution" in ns:  # LeetCode-style starter code
        return getattr(ns["Solution"](), name)
    raise NameError(f"name {name!r} is not defined")

SPEC = {}

def main():
    spec = json.loads(sys.stdin.read())
    tag = "@@" + spec.pop("tag") + "@@ "  # kept out of SPEC: `import __main__` would hand a program the globals
    SPEC.update(spec)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    def emit(obj):
        out.write(tag + json.dumps(obj) + "\n")
        out.flush()
    signal.signal(signal.SIGALRM, _alarm)
    budget, tests = spec["timeout"], spec["tests"]
    emit({"start": True})
    code, ns, load_error = None, {"__name__": "solution"}, None
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, budget)
            code = compile(spec["code"], "solution.py", "exec")
            if any(t["kind"] != "stdio" for t in tests):
                exec(code, ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        load_error = "timeout"
    except BaseException as e:
        load_error = f"{type(e).__name__}: {e}"[:300]
    for i, t in enumerate(tests):
        start = time.perf_counter()
        res = {"i": i, "status": "ok"}
        try:
            try:
                if load_error == "timeout" and t["kind"] != "stdio":
                    raise _Timeout()
                if load_error is not None and (code is None or t["kind"] != "stdio"):
                    raise RuntimeError(load_error)
                signal.setitimer(signal.ITIMER_REAL, budget)
                if t["kind"] == "call":
                    text = json.dumps(_find(ns, t["fn"])(*t["args"]), sort_keys=True)
                    res.update(_encode(text, lambda s: s))
                elif t["kind"] == "assert":
                    exec(t["code"], ns)
                else:
                    res.update(_encode(_stdio(code, t["input"], null), normalize_output))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            res = {"i": i, "status": "timeout"}
        except BaseException as e:
            res = {"i": i, "status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
        res["ms"] = round(1000 * (time.perf_counter() - start), 1)
        emit(res)
    emit({"done": True})
    os._exit(0)  # threads or handlers the program left behind do not get to run

main()
'''


@dataclass(frozen=True)
class CodeScore:
    """One trajectory's grade: `reward` None = could not be scored (sandbox failure, not the program's)."""

    reward: float | None
    passed: int
    total: int
    isolation: str  # "bwrap" | "process" | "" (no sandbox run: no code found)
    metrics: dict[str, float] = field(default_factory=dict)
    per_test: tuple[bool, ...] = ()  # whether each test passed, in the order given (empty when nothing ran)


class CodeEnv(Env):
    """Single-turn code generation with sandboxed hidden tests; one role, `policy`.

    Problems come from `SyntheticTasks` (default) or a JSONL file (`data=`, HumanEval/MBPP/LiveCodeBench shapes,
    `jsonl.load_problems`). With one file, `n_heldout` of its problems (a seeded choice) form the held-out split and
    the rest the train stream; `heldout_data=` names a separate held-out file instead.
    """

    name = "code"
    roles = ("policy",)

    def __init__(self, data: str | None = None, format: Format = "auto", heldout_data: str | None = None,
                 levels: Sequence[int] = (1, 2, 3), n_heldout: int = 128, seed: int = 1234, n_tests: int = 5,
                 test_timeout_s: float = 2.0, isolation: Isolation = "auto", memory_mb: int = 512,
                 max_procs: int | None = None, run_memory_mb: int | None = None, cgroup: bool | None = None,
                 max_parallel: int | None = None, system_prompt: str | None = None) -> None:
        if test_timeout_s <= 0:
            raise ValueError(f"test_timeout_s must be > 0, got {test_timeout_s}")
        if heldout_data is not None and data is None:
            raise ValueError("heldout_data needs data= (the train file) as well")
        self.seed, self.test_timeout_s, self.system_prompt = seed, test_timeout_s, system_prompt
        self.sandbox_config = {"isolation": isolation, "memory_mb": memory_mb, "max_procs": max_procs,
                               "run_memory_mb": run_memory_mb, "cgroup": cgroup, "max_output_bytes": 4 << 20}
        self.max_parallel = max_parallel or os.cpu_count() or 1
        self._sandbox: Sandbox | None = None  # built at first score: constructing an env starts nothing
        self._synthetic: SyntheticTasks | None = None
        if data is None:
            self._synthetic = SyntheticTasks(levels=levels, n_heldout=n_heldout, seed=seed, n_tests=n_tests)
            self._heldout = [self._task(p, "heldout") for p in self._synthetic.heldout()]
            self._train: list[Task] = []
        else:
            problems = load_problems(data, format)
            if heldout_data is not None:
                held = load_problems(heldout_data, format)
            else:
                if n_heldout >= len(problems):
                    raise ValueError(f"{data} has {len(problems)} problems, too few for n_heldout={n_heldout} "
                                     "plus a train split; lower n_heldout or pass heldout_data=")
                order = list(range(len(problems)))
                random.Random(f"{seed}/heldout").shuffle(order)
                chosen = set(order[:n_heldout])
                held = [p for i, p in enumerate(problems) if i in chosen]
                problems = [p for i, p in enumerate(problems) if i not in chosen]
            held_ids = {p.problem_id for p in held}
            self._heldout = [self._task(p, "heldout") for p in held]
            self._train = [self._task(p, "train") for p in problems if p.problem_id not in held_ids]
            if not self._train:
                raise ValueError(f"{data}: every problem is also in the held-out file {heldout_data}")

    def __repr__(self) -> str:
        source = "synthetic" if self._synthetic else f"{len(self._train)} train problems"
        isolation = self._sandbox.isolation if self._sandbox else self.sandbox_config["isolation"]
        return f"CodeEnv({source}, heldout={len(self._heldout)}, isolation={isolation!r})"

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(**self.sandbox_config)
        return self._sandbox

    # --------------------------------------------------------------------------------------------------- tasks
    def _task(self, p: CodeProblem, split: str) -> Task:
        what = "function (with any imports it needs)" if p.entry_point else "program"
        prompt = f"{p.prompt}\n\nAnswer with the complete Python {what} in a single ```python code block."
        info = {"tests": list(p.tests), "entry_point": p.entry_point, "reference": p.reference, "prefix": p.prefix,
                **p.meta}
        return Task(task_id=f"{self.name}/{p.problem_id}", env=self.name, prompt=prompt, info=info,
                    split=split)  # type: ignore[arg-type]

    def tasks(self, split: str) -> Iterator[Task]:
        if split == "heldout":
            return iter(self._heldout)
        if split != "train":
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
        if self._synthetic is not None:
            return (self._task(p, "train") for p in self._synthetic.train())
        return self._train_stream()

    def _train_stream(self) -> Iterator[Task]:
        for epoch in itertools.count():
            order = list(self._train)
            random.Random(f"{self.seed}/train/{epoch}").shuffle(order)
            yield from order

    def demonstration(self, task: Task) -> str:
        if not task.info.get("reference"):
            raise NotImplementedError(f"task {task.task_id} has no reference solution")
        return f"```python\n{task.info['reference'].rstrip()}\n```"

    # ------------------------------------------------------------------------------------------------- rollout
    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": task.prompt}]

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        return [await single_turn(engines["policy"], self.messages(task), sampling, task=task, group_id=group_id,
                                  policy_id=policy_ids["policy"])]

    # --------------------------------------------------------------------------------------------------- score
    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        return [s.reward for s in self.score_details(task, [t.text for t in trajectories])]

    def score_with_metrics(self, task: Task, trajectories: Sequence[Trajectory]
                           ) -> list[tuple[float | None, dict[str, float]]]:
        """Rewards with the sandbox's per-trajectory metrics (tests passed, timeouts, isolation used)."""
        return [(s.reward, dict(s.metrics)) for s in self.score_details(task, [t.text for t in trajectories])]

    def grade(self, task: Task, text: str) -> float:
        reward = self.score_details(task, [text])[0].reward
        return 0.0 if reward is None else reward

    def score_details(self, task: Task, texts: Sequence[str]) -> list[CodeScore]:
        """Grade completion texts; identical extracted programs run once. Runs sandboxes concurrently."""
        codes = [solution_code(text, task.info.get("entry_point"), task.info.get("prefix", "")) for text in texts]
        unique = sorted({c for c in codes if c is not None})
        with ThreadPoolExecutor(max_workers=max(1, min(len(unique), self.max_parallel))) as pool:
            graded = dict(zip(unique, pool.map(lambda c: self._grade_code(task, c), unique), strict=True))
        n = len(task.info["tests"])
        none = CodeScore(0.0, 0, n, "", {"code/tests_passed": 0.0, "code/tests_total": float(n),
                                         "code/no_code": 1.0})
        return [graded[c] if c is not None else none for c in codes]

    def _grade_code(self, task: Task, code: str) -> CodeScore:
        return self.run_tests(code, task.info["tests"])

    def run_tests(self, code: str, tests: Sequence[dict[str, Any]]) -> CodeScore:
        """Run `code` against `tests` (the `tasks.py` test shapes) in one sandbox run; reward = fraction passed.
        Workflows use it for tests that are not the task's own (e.g. a test generator's asserts)."""
        tag = secrets.token_hex(16)
        visible = [{k: v for k, v in t.items() if k != "expected"} for t in tests]
        spec = json.dumps({"tag": tag, "code": code, "tests": visible, "timeout": self.test_timeout_s,
                           "inline": INLINE_BYTES, "capture": CAPTURE_BYTES})
        budget = self.test_timeout_s * (len(tests) + 1)
        result = self.sandbox.run(HARNESS, stdin=spec, wall_s=budget + 5.0, cpu_s=budget + 1.0)
        return _grade_result(tests, result, f"@@{tag}@@ ")


def _grade_result(tests: Sequence[dict[str, Any]], result: SandboxResult, tag: str) -> CodeScore:
    n = len(tests)
    reports: dict[int, dict[str, Any]] = {}
    started = tampered = False
    for line in result.stdout.splitlines():
        if not line.startswith(tag):
            continue
        try:
            rec = json.loads(line[len(tag):])
        except json.JSONDecodeError:
            tampered = True
            continue
        started = started or bool(rec.get("start"))
        i = rec.get("i")
        if isinstance(i, int):
            if i in reports or not 0 <= i < n:
                tampered = True
            reports[i] = rec
    per_test = tuple(not tampered and i in reports and _passed(tests[i], reports[i]) for i in range(n))
    passed = sum(per_test)
    statuses = [r.get("status") for r in reports.values()]
    metrics = {"code/tests_passed": float(passed), "code/tests_total": float(n),
               "code/timeouts": float(statuses.count("timeout") + (n - len(reports) if result.timed_out else 0)),
               "code/errors": float(statuses.count("error")), "code/no_code": 0.0,
               "code/isolation_bwrap": float(result.isolation == "bwrap"), "code/own_uid": float(result.own_uid),
               "code/sandbox_s": result.wall_s, "code/tampered": float(tampered),
               "code/output_limit": float(result.killed_by == "output_limit"),
               "code/memory_limit": float(result.killed_by == "memory_limit"), "code/cgroup": float(result.cgroup),
               "code/own_network": float(result.own_network), "code/own_mounts": float(result.own_mounts)}
    # no start line and no timeout: the sandbox or interpreter failed before any of the program ran
    reward = None if not started and not result.timed_out and not tampered else passed / n
    metrics["code/infra_error"] = float(reward is None)
    return CodeScore(reward, passed, n, result.isolation, metrics, per_test)


def _passed(test: dict[str, Any], rec: dict[str, Any]) -> bool:
    if rec.get("status") != "ok":
        return False
    kind = test["kind"]
    if kind == "assert":
        return True
    if kind == "call":
        canonical = json.dumps(test["expected"], sort_keys=True)
        if "sha" in rec:
            return rec["sha"] == hashlib.sha256(canonical.encode()).hexdigest()
        try:
            return _same(json.loads(rec["text"]), test["expected"])
        except (KeyError, TypeError, json.JSONDecodeError):
            return False
    expected = normalize_output(test["expected"])
    if "sha" in rec:
        return rec["sha"] == hashlib.sha256(expected.encode("utf-8", "replace")).hexdigest()
    got = normalize_output(str(rec.get("text", "")))
    return got == expected or _same_tokens(got, expected)


def _same(a: Any, b: Any) -> bool:
    """JSON values equal, floats to 1e-6 relative (bool is not a number here: True != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _same_tokens(got: str, expected: str) -> bool:
    """Printed answers equal token by token, numbers to 1e-6 relative (LiveCodeBench's tolerance)."""
    g, e = got.split(), expected.split()
    if len(g) != len(e):
        return False
    for x, y in zip(g, e, strict=True):
        if x == y:
            continue
        try:
            if not math.isclose(float(x), float(y), rel_tol=1e-6, abs_tol=1e-9):
                return False
        except ValueError:
            return False
    return True


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str, entry_point: str | None = None) -> str | None:
    """The program in a completion: the last ```python block (the last one defining `entry_point` when given), or any
    fenced block, or the whole text when it has no fences and parses as Python. An unclosed final fence (the token
    budget ran out) counts up to the end of the text. None when nothing usable is there."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if blocks:
        python = [b for lang, b in blocks if lang in ("python", "py", "python3", "")] or [b for _, b in blocks]
        if entry_point:
            defining = [b for b in python if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", b)]
            python = defining or python
        code = python[-1]
        return code if code.strip() else None
    try:
        ast.parse(text)
    except SyntaxError:
        return None
    return text if text.strip() else None


def solution_code(text: str, entry_point: str | None, prefix: str = "") -> str | None:
    """`extract_code`, continuing `prefix` (HumanEval's prompt) when the code is a body that never defines the
    entry point."""
    code = extract_code(text, entry_point)
    if code is None:
        return None
    if prefix and entry_point and not re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", code):
        return prefix + code
    return code
