"""Load programming problems from JSONL files in the three common shapes, one JSON object per line:

| format | fields read | tests |
|---|---|---|
| `humaneval` | task_id, prompt, canonical_solution, test, entry_point | each `assert` of `check(candidate)` is one test when the body is only asserts; otherwise `check` is one test |
| `mbpp` | task_id, text (or prompt), code, test_list, test_setup_code? | each line of test_list |
| `livecodebench` | question_id?, question_content, public_test_cases, private_test_cases, starter_code?, metadata? | each case: `stdin` cases feed input and compare printed output; `functional` cases call metadata's func_name with one JSON argument per input line |

`format="auto"` decides per line by the fields present. LiveCodeBench's test-case fields may be JSON text or a list;
its released files compress private cases (base64 of zlib of a pickled JSON string): those are decoded with an
unpickler that refuses every object but plain strings, so a crafted file cannot run code here.

A malformed file raises `ValueError("<path>:<line>: <what is wrong>")` (lines counted from 1); nothing is skipped
silently, except blank lines.

Example:
    >>> problems = load_problems("HumanEval.jsonl")  # doctest: +SKIP
    >>> problems[0].problem_id, len(problems[0].tests)  # doctest: +SKIP
    ('HumanEval/0', 7)
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import pickle
import zlib
from collections.abc import Callable
from typing import Any, Literal

from astratk.envs.code.tasks import CodeProblem, Test
from astratk.envs.jsonl import records

Format = Literal["auto", "humaneval", "mbpp", "livecodebench"]


def load_problems(path: str | os.PathLike[str], format: Format = "auto") -> list[CodeProblem]:
    """Every problem in the file, in file order. Raises ValueError naming the file and 1-based line on any defect."""
    if format not in _PARSERS and format != "auto":
        raise ValueError(f"unknown format {format!r}; choose 'auto', {', '.join(map(repr, sorted(_PARSERS)))}")
    path = os.fspath(path)
    problems: list[CodeProblem] = []
    seen: dict[str, int] = {}
    for lineno, row in records(path):
        where = f"{path}:{lineno}"
        fmt = _detect(row, where) if format == "auto" else format
        try:
            problem = _PARSERS[fmt](row, lineno)
        except (_Bad, SyntaxError) as e:
            raise ValueError(f"{where}: {fmt} problem: {e}") from None
        if problem.problem_id in seen:
            raise ValueError(f"{where}: duplicate id {problem.problem_id!r} (first on line {seen[problem.problem_id]})")
        seen[problem.problem_id] = lineno
        problems.append(problem)
    if not problems:
        raise ValueError(f"{path}: no problems (the file is empty)")
    return problems


class _Bad(Exception):
    """A field is missing or malformed; the loader adds file and line."""


def _detect(row: dict[str, Any], where: str) -> str:
    if "question_content" in row:
        return "livecodebench"
    if "test_list" in row:
        return "mbpp"
    if "entry_point" in row and "test" in row:
        return "humaneval"
    raise ValueError(f"{where}: cannot tell the format from fields {sorted(row)}; expected HumanEval (prompt, test, "
                     "entry_point), MBPP (text, code, test_list) or LiveCodeBench (question_content, "
                     "public_test_cases, private_test_cases), or pass format=")


def _str(row: dict[str, Any], key: str, required: bool = True) -> str:
    v = row.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or (required and not v.strip()):
        raise _Bad(f"field {key!r} must be a non-empty string, got {_short(v)}")
    return v


def _short(v: Any) -> str:
    return "missing" if v is None else f"{type(v).__name__} {str(v)[:40]!r}"


# ------------------------------------------------------------------------------------------------------ HumanEval
def _humaneval(row: dict[str, Any], lineno: int) -> CodeProblem:
    prompt, test, entry = _str(row, "prompt"), _str(row, "test"), _str(row, "entry_point")
    if not entry.isidentifier():
        raise _Bad(f"entry_point {entry!r} is not a Python identifier")
    tree = ast.parse(test)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        raise _Bad("field 'test' defines no `check(candidate)` function")
    setup = ast.unparse(ast.Module(body=[n for n in tree.body if n is not check], type_ignores=[]))
    body = [n for n in check.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    arg = check.args.args[0].arg if check.args.args else "candidate"
    if body and all(isinstance(n, ast.Assert) for n in body):  # one test per assert: partial credit
        tests = [f"{setup}\ndef check({arg}):\n    {ast.unparse(n)}\ncheck({entry})\n" for n in body]
    else:
        tests = [f"{test}\ncheck({entry})\n"]
    reference = prompt + row["canonical_solution"] if isinstance(row.get("canonical_solution"), str) else None
    return CodeProblem(problem_id=str(row.get("task_id", f"humaneval/{lineno}")), prompt=prompt,
                       tests=tuple({"kind": "assert", "code": t} for t in tests), entry_point=entry,
                       reference=reference, prefix=prompt, meta={"source": "humaneval"})


# ----------------------------------------------------------------------------------------------------------- MBPP
def _mbpp(row: dict[str, Any], lineno: int) -> CodeProblem:
    text = _str(row, "text") if "text" in row else _str(row, "prompt")
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise _Bad(f"field 'test_list' must be a non-empty list of assert strings, got {_short(tests)}")
    for t in tests:
        ast.parse(t)
    setup = _str(row, "test_setup_code", required=False)
    code = row.get("code")
    entry = _mbpp_entry(code if isinstance(code, str) else None, tests[0])
    prompt = f"{text}\nYour function must be named `{entry}` and satisfy, for example:\n    {tests[0]}"
    return CodeProblem(problem_id=f"mbpp/{row.get('task_id', lineno)}", prompt=prompt,
                       tests=tuple({"kind": "assert", "code": f"{setup}\n{t}\n"} for t in tests), entry_point=entry,
                       reference=code if isinstance(code, str) else None, meta={"source": "mbpp"})


def _mbpp_entry(code: str | None, first_test: str) -> str:
    """The function the tests call: the first function called in the first test that the reference defines (or
    the first called at all)."""
    defined = {n.name for n in ast.walk(ast.parse(code))
               if isinstance(n, ast.FunctionDef)} if code else set()
    called = [n.func.id for n in ast.walk(ast.parse(first_test))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    for name in called:
        if name in defined or not defined:
            return name
    raise _Bad(f"cannot tell which function the tests call (first test {first_test!r})")


# -------------------------------------------------------------------------------------------------- LiveCodeBench
def _livecodebench(row: dict[str, Any], lineno: int) -> CodeProblem:
    question = _str(row, "question_content")
    starter = _str(row, "starter_code", required=False)
    meta = row.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except json.JSONDecodeError:
            raise _Bad("field 'metadata' is not valid JSON") from None
    cases = _cases(row, "public_test_cases") + _cases(row, "private_test_cases")
    if not cases:
        raise _Bad("no test cases in public_test_cases or private_test_cases")
    func = meta.get("func_name") if isinstance(meta, dict) else None
    tests: list[Test] = []
    for i, c in enumerate(cases):
        if not isinstance(c, dict) or not isinstance(c.get("input"), str) or not isinstance(c.get("output"), str):
            raise _Bad(f"test case {i} must be an object with string 'input' and 'output', got {_short(c)}")
        if c.get("testtype", "stdin") == "functional":
            if not isinstance(func, str) or not func.isidentifier():
                raise _Bad("functional test cases need metadata.func_name")
            try:
                args = [json.loads(a) for a in c["input"].split("\n") if a.strip()]
                expected = json.loads(c["output"])
            except json.JSONDecodeError:
                raise _Bad(f"functional test case {i}: input lines and output must be JSON") from None
            tests.append({"kind": "call", "fn": func, "args": args, "expected": expected})
        else:
            tests.append({"kind": "stdio", "input": c["input"], "expected": c["output"]})
    functional = any(t["kind"] == "call" for t in tests)
    how = ("Complete the code below." if functional else
           "Read the input from standard input and write the answer to standard output.")
    prompt = f"{question}\n\n{how}" + (f"\n\n```python\n{starter}\n```" if starter.strip() else "")
    return CodeProblem(problem_id=f"livecodebench/{row.get('question_id', lineno)}", prompt=prompt,
                       tests=tuple(tests), entry_point=func if functional else None,
                       meta={"source": "livecodebench", "difficulty": row.get("difficulty")})


def _cases(row: dict[str, Any], key: str) -> list[Any]:
    v = row.get(key)
    if v is None or v == "":
        return []
    if isinstance(v, list):
        return v
    if not isinstance(v, str):
        raise _Bad(f"field {key!r} must be a list or JSON text, got {_short(v)}")
    try:
        out = json.loads(v)
    except json.JSONDecodeError:
        try:
            out = json.loads(_decompress(v, key))
        except json.JSONDecodeError as e:
            raise _Bad(f"field {key!r} decompressed to invalid JSON ({e.msg})") from None
    if not isinstance(out, list):
        raise _Bad(f"field {key!r} must hold a JSON list of test cases, got {_short(out)}")
    return out


class _StringsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain strings are accepted")


def _decompress(text: str, key: str) -> str:
    """LiveCodeBench's release format: base64(zlib(pickle(json_text)))."""
    try:
        out = _StringsOnly(io.BytesIO(zlib.decompress(base64.b64decode(text, validate=True)))).load()
    except Exception as e:  # noqa: BLE001 - any decoding failure means the field is malformed
        raise _Bad(f"field {key!r} is neither JSON nor base64/zlib/pickled JSON ({type(e).__name__}: {e})") from None
    if not isinstance(out, str):
        raise _Bad(f"field {key!r} decompressed to {type(out).__name__}, expected JSON text")
    return out


_PARSERS: dict[str, Callable[[dict[str, Any], int], CodeProblem]] = {
    "humaneval": _humaneval, "mbpp": _mbpp, "livecodebench": _livecodebench,
}
