"""`MathGrader`: is a model's final answer equal to the gold answer? `math-verify` decides, safely from any thread.

Which answer is graded (`final_answer`), first rule that applies:
1. the content of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed (an empty box: no answer);
2. the text after the last `####` (GSM8K's marker), up to the end of its line;
3. the last number in the text: an integer (thousands commas allowed: `1,000`), a decimal, a fraction `a/b` or
   `\\frac{a}{b}`, with an optional minus sign;
otherwise there is no answer and the reward is 0.
So a bare `42` (what the tiny model is warm-started to say) and `... so the answer is \\boxed{\\frac{1}{2}}` are both
graded. Equality is math-verify's `verify(parse(gold), parse(answer))` (numeric within 6 decimals, symbolic, LaTeX,
sets, intervals); when math-verify cannot parse one side into an expression, the normalised strings must be equal
(`exact_fallback` counts those).

Why a child process: math-verify bounds its own work with SIGALRM, which exists only in the main thread;
in a Dask task thread `parse` raises ValueError unless `parsing_timeout=None`, and `verify` needs
`timeout_seconds=None`. Without a bound, short inputs hang: `\\boxed{9^{9^{9^{9}}}}` (21 characters) makes `verify` run
past 10 s against the gold `1` (we stopped it there) while sympy works on the tower; and SIGALRM only interrupts Python
between bytecodes, so a long C-level operation (a big-integer power) would not be cut short anyway. So the call is
bounded at process level: a persistent child process grades one answer at a time; when it overruns `timeout_s` it is
killed (and started again on the next call), `timeouts` counts it, and the answer scores by the exact-match
fallback alone (1 only when its normalised string equals the gold's). The child is a plain
`subprocess`, not `multiprocessing`: Dask workers are daemonic processes, and multiprocessing refuses to start a child
from one (`AssertionError: daemonic processes are not allowed to have children`, seen here with spawn, forkserver and
fork). The child loads this file by path, so it imports no torch; it exits when its stdin closes or its parent dies.

The fast path: when the gold answer and the model's answer are both plain numeric literals (rule 3's grammar, at
most `SIMPLE_MAX_CHARS` characters), math-verify runs in the calling thread with its timeouts disabled. That is safe
because such inputs cannot grow: no powers, factorials or symbols, and a bounded number of digits, so parsing and
comparing them is a few milliseconds at most. A length cap alone would not be safe (the tower above is short).
Measured here (bench/env_math.py, 2 shared cores, distinct inputs so math-verify's parse caches miss): fast path
1.1 ms a numeric grading; child path 1.4 ms numeric, 2.4 ms LaTeX (6.6 ms on a loaded machine); starting the child
0.4-1.0 s (once per process, and again after each timeout). So the fast path saves little per call; it mainly means
numeric-only envs (arithmetic, word problems, GSM8K) never start a child at all.

This file imports only the standard library at module level (the child loads it by path without the package).

Example:
    >>> grader = MathGrader(timeout_s=5.0)
    >>> grader.grade("1/2", "so x = \\\\boxed{\\\\frac{1}{2}}"), grader.grade("1000", "1,000"), grader.grade("7", "8")
    (1.0, 1.0, 0.0)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

SIMPLE_MAX_CHARS = 40  # longest numeric literal graded in the calling thread (fast path)
INSTALL_HINT = "pip install 'math-verify[antlr4_13_2]==0.9.0'"

_NUMBER = (r"-?(?:\\[dt]?frac\{\d+\}\{\d+\}"  # \frac{1}{2}
           r"|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?)")  # 1,000  12  3.5  1/2
# Not glued to a word or a decimal point before it, nor to a digit after it (so '5-3' ends in '3', not '-3').
_LAST_NUMBER = re.compile(r"(?<![\w.])" + _NUMBER + r"(?!\d)")
_SIMPLE = re.compile(_NUMBER)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character (\{ and \} do not count) or a brace


# ------------------------------------------------------------------------------------------------ extraction
def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...}; an unclosed one (a truncated completion) is passed over.

    One pass over the braces from the first box on (so a completion full of unclosed boxes costs linear time)."""
    opening = {m.end() - 1 for m in _BOX.finditer(text)}  # positions of the braces that open a box
    if not opening:
        return None
    stack: list[int] = []
    last: tuple[int, int] | None = None
    for m in _BRACE.finditer(text, min(opening)):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            start = stack.pop()
            if start in opening and (last is None or start > last[0]):
                last = (start, m.start())
    return text[last[0] + 1:last[1]].strip() if last else None


def final_answer(text: str) -> str | None:
    """The answer a completion gives, by the module docstring's rule; None when it gives none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed or None  # an empty box is an answer of nothing
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        return tail[0].strip() if tail and tail[0].strip() else None
    matches = list(_LAST_NUMBER.finditer(text))
    return matches[-1].group(0) if matches else None


def is_simple(answer: str) -> bool:
    """A plain numeric literal that math-verify grades in bounded time (the fast path)."""
    answer = answer.strip()
    return len(answer) <= SIMPLE_MAX_CHARS and _SIMPLE.fullmatch(answer) is not None


def normalize(answer: str) -> str:
    """The string the exact-match fallback compares: no math delimiters, spacing, \\text{}, \\left/\\right, trailing
    period or thousands commas."""
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ "):
        s = s.replace(junk, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


# ------------------------------------------------------------------------------------------------ math-verify
class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off: we bound the call ourselves (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _install_filter() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietTimeoutWarning) for f in logger.filters):
            logger.addFilter(_QuietTimeoutWarning())


def verdict(gold: str, answer: str) -> str:
    """'match', 'nomatch', or 'unparsed' (math-verify found no expression on one side). Unbounded: call it only on
    simple inputs or in the child."""
    from math_verify import parse, verify

    # \boxed{} tells math-verify's extractor exactly where the expression is (it handles nested LaTeX and commas).
    g = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    a = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    if all(isinstance(x, str) for x in g) or all(isinstance(x, str) for x in a):
        return "unparsed"
    return "match" if verify(g, a, timeout_seconds=None) else "nomatch"


# ------------------------------------------------------------------------------------------------------- child
_BOOT = ("import importlib.util, json, sys; sys.path[:] = json.loads(sys.argv[2]); "
         "s = importlib.util.spec_from_file_location('_astratk_math_grading_child', sys.argv[1]); "
         "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); "
         "m._serve(float(sys.argv[3]))")


class _ChildDied(RuntimeError):
    pass


class _Child:
    """One grading child process: JSON lines in on stdin, JSON lines out on a private copy of stdout."""

    def __init__(self, start_timeout_s: float, delay_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, os.path.abspath(__file__), json.dumps(sys.path),
                                      str(delay_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buf = b""
        self._poll = select.poll()  # not select(): a Dask worker may hold more than FD_SETSIZE (1024) descriptors
        self._poll.register(self.proc.stdout.fileno(), select.POLLIN)  # type: ignore[union-attr]
        self.owner = os.getpid()
        weakref.finalize(self, _Child._kill, self.proc, self.owner)  # no orphan when the grader is dropped or at exit
        try:
            ready = self._read(start_timeout_s)
        except _ChildDied:
            ready = None
        if ready != {"ready": True}:
            self.close()
            raise RuntimeError(f"the math-verify grading child did not start within {start_timeout_s:.0f} s (exit "
                               f"code {self.proc.returncode}); see its stderr above. Is math-verify installed for "
                               f"{sys.executable}? {INSTALL_HINT}")

    def ask(self, gold: str, answer: str, timeout_s: float) -> dict[str, Any] | None:
        """The child's reply, or None when it did not answer within timeout_s (the caller kills it)."""
        data = json.dumps({"gold": gold, "answer": answer}).encode() + b"\n"
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.proc.stdin.fileno(), view):]  # type: ignore[union-attr]
        except (BrokenPipeError, OSError) as e:
            raise _ChildDied(f"grading child gone: {e}") from e
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._poll.poll(left * 1000):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _ChildDied(f"grading child exited (code {self.proc.poll()})")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        _Child._kill(self.proc, self.owner)

    @staticmethod
    def _kill(proc: subprocess.Popen, owner: int) -> None:
        if os.getpid() != owner:  # a forked copy of the parent: the child is not ours to kill
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was ignored: nothing more to do
            pass
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def _exit_with_parent(ppid: int) -> None:
    while os.getppid() == ppid:
        time.sleep(0.5)
    os._exit(0)  # the parent died (e.g. a killed Dask worker): do not linger in a long sympy computation


def _serve(delay_s: float = 0.0) -> None:
    """The child's loop. `delay_s` (tests only) sleeps before each comparison to imitate a hanging verify."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a stray print() from a library must not corrupt the replies
    _install_filter()
    verdict("1", "1")  # import math-verify and warm its parsers before saying ready
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    out.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        req = json.loads(line)
        time.sleep(delay_s)
        try:
            reply: dict[str, Any] = {"verdict": verdict(req["gold"], req["answer"])}
        except Exception as e:  # noqa: BLE001 - any failure is reported to the parent, which scores it
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply).encode() + b"\n")


# ------------------------------------------------------------------------------------------------------ grader
OUTCOMES = ("verified", "exact_fallback", "no_answer", "timeout", "child_error")
COUNTERS = ("graded", "fast_path", "child", "no_answer", "exact_fallback", "timeouts", "child_errors",
            "child_starts")


class MathGrader:
    """Reward 1.0 when a completion's final answer equals the gold answer, else 0.0; thread-safe and picklable.

    `timeout_s` bounds one child-process grading (a timeout scores 0); `fast_path` grades plain numeric literals in
    the calling thread (module docstring); `start_timeout_s` bounds the child's start (imports sympy). Counters
    (`counts`, or `metrics()`): graded, fast_path, child, no_answer, exact_fallback, timeouts, child_errors,
    child_starts. A pickled grader (a Dask task) carries its settings, not its child or counters.

    Example:
        >>> g = MathGrader()
        >>> g.grade("\\\\frac{\\\\sqrt{3}}{2}", "The answer is \\\\boxed{\\\\frac{\\\\sqrt3}{2}}")
        1.0
        >>> g.close()
    """

    _child_delay_s = 0.0  # test hook: the child sleeps this long before each comparison (a slow verify)

    def __init__(self, timeout_s: float = 5.0, fast_path: bool = True, start_timeout_s: float = 60.0) -> None:
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"timeout_s and start_timeout_s must be > 0, got {timeout_s} and {start_timeout_s}")
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(f"MathGrader needs the math-verify library, which is not installed: {INSTALL_HINT}")
        self.timeout_s = float(timeout_s)
        self.fast_path = bool(fast_path)
        self.start_timeout_s = float(start_timeout_s)
        self._setup()

    def _setup(self) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()  # one child request at a time; also guards the counters
        self._child: _Child | None = None
        _install_filter()

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "fast_path": self.fast_path, "start_timeout_s": self.start_timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        return f"MathGrader(timeout_s={self.timeout_s}, fast_path={self.fast_path}, counts={self.counts})"

    # ---------------------------------------------------------------------------------------------- public
    def grade(self, gold: str, text: str) -> float:
        """1.0 if `text`'s final answer (module docstring) equals `gold`, else 0.0 (no answer; on a timeout only an
        answer identical to the gold after normalising scores)."""
        return self.grade_outcome(gold, text)[0]

    def grade_outcome(self, gold: str, text: str) -> tuple[float, str]:
        """(reward, outcome); the outcome is one of `OUTCOMES`: 'verified' (math-verify decided), 'exact_fallback',
        'no_answer' (scores 0), 'timeout' or 'child_error' (math-verify gave no verdict: scored by exact match)."""
        answer = final_answer(text)
        if answer is None:
            self._count("graded", "no_answer")
            return 0.0, "no_answer"
        gold = str(gold)
        if self.fast_path and is_simple(gold) and is_simple(answer):
            self._count("graded", "fast_path")
            result = verdict(gold.strip(), answer.strip())
        else:
            result = self._ask_child(gold, answer)
        if result in ("timeout", "child_error"):  # math-verify gave no verdict: only identical answers score
            return float(normalize(gold) != "" and normalize(gold) == normalize(answer)), result
        if result == "unparsed":
            self._count("exact_fallback")
            return float(normalize(gold) != "" and normalize(gold) == normalize(answer)), "exact_fallback"
        return float(result == "match"), "verified"

    def metrics(self) -> dict[str, float]:
        return {f"grader/{k}": float(v) for k, v in self.counts.items()}

    def start(self) -> None:
        """Start the child now rather than at the first non-numeric answer (e.g. before timing a benchmark)."""
        with self._lock:
            self._ensure_child()

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None

    # ---------------------------------------------------------------------------------------------- child
    def _count(self, *names: str) -> None:
        with self._lock:
            for n in names:
                self.counts[n] += 1

    def _ensure_child(self) -> _Child:
        if self._child is not None and self._child.owner != os.getpid():
            self._child = None  # this process was forked from the one that started it: start our own
        if self._child is None or self._child.proc.poll() is not None:
            self._child = _Child(self.start_timeout_s, self._child_delay_s)
            self.counts["child_starts"] += 1
        return self._child

    def _ask_child(self, gold: str, answer: str) -> str:
        """The child's verdict, or 'timeout' / 'child_error' (counted; the child is replaced)."""
        with self._lock:
            self.counts["graded"] += 1
            self.counts["child"] += 1
            child = self._ensure_child()
            try:
                reply = child.ask(gold, answer, self.timeout_s)
            except _ChildDied:
                reply = {"error": "child died"}
            if reply is None:
                self.counts["timeouts"] += 1
                child.close()
                self._child = None
                return "timeout"
            if "error" in reply:
                self.counts["child_errors"] += 1
                if child.proc.poll() is not None:
                    self._child = None
                return "child_error"
            return str(reply["verdict"])
