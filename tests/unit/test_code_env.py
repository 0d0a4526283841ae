"""The code env: synthetic tasks are deterministic with a disjoint held-out split; reference solutions score 1,
partial ones the fraction of hidden tests they pass, hostile ones 0 with the host unaffected; HumanEval / MBPP /
LiveCodeBench-style files load (and malformed ones are rejected with file and line); code is found in completions."""

from __future__ import annotations

import asyncio
import base64
import collections
import itertools
import json
import os
import pickle
import socket
import uuid
import zlib

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.code import cgroup
from astratk.envs.code.env import CodeEnv, extract_code, solution_code
from astratk.envs.code.jsonl import load_problems
from astratk.envs.code.tasks import FAMILIES, SyntheticTasks
from astratk.models import build_char_tokenizer
from tests.unit.test_sandbox import MODES, ROOT, UID_BASE, UID_SLOTS, host_is_fine, need_cgroup, need_mode


def block(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\n"


# ------------------------------------------------------------------------------------------------------ tasks
def test_synthetic_tasks_are_deterministic_and_heldout_is_disjoint():
    a, b = SyntheticTasks(n_heldout=40, seed=7), SyntheticTasks(n_heldout=40, seed=7)
    assert [p.problem_id for p in a.heldout()] == [p.problem_id for p in b.heldout()]
    assert [p.tests for p in a.heldout()] == [p.tests for p in b.heldout()]
    train_a = [p.problem_id for p in itertools.islice(a.train(), 300)]
    assert train_a == [p.problem_id for p in itertools.islice(b.train(), 300)]
    assert not set(train_a) & {p.problem_id for p in a.heldout()}
    assert len(a.heldout()) == 40 == len({p.problem_id for p in a.heldout()})
    other = SyntheticTasks(n_heldout=40, seed=8)
    assert [p.problem_id for p in other.heldout()] != [p.problem_id for p in a.heldout()]
    assert {p.meta["level"] for p in a.heldout()} == {1, 2, 3}
    only2 = SyntheticTasks(levels=(2,), n_heldout=5, seed=0)
    assert {p.meta["level"] for p in only2.heldout()} == {2}
    with pytest.raises(ValueError, match="levels"):
        SyntheticTasks(levels=(9,))


def test_every_family_has_distinct_hidden_tests_not_shown_in_the_prompt():
    gen = SyntheticTasks(n_heldout=0, seed=0)
    for family in FAMILIES:
        p = next(p for p in gen.train() if p.entry_point == family.name)
        assert len(p.tests) == 5 and all(t["kind"] == "call" for t in p.tests)
        assert len({json.dumps(t["args"]) for t in p.tests}) == 5
        for t in p.tests:  # the examples in the prompt are other inputs
            assert f"{family.name}({', '.join(map(repr, t['args']))}) ==" not in p.prompt


# ------------------------------------------------------------------------------------------------------ scoring
@pytest.fixture(scope="module", params=MODES)
def env(request):
    need_mode(request.param)
    env = CodeEnv(levels=(1, 2, 3), n_heldout=6, seed=3, test_timeout_s=0.5, isolation=request.param,
                  memory_mb=256, max_procs=16)
    env.sandbox.uid_base, env.sandbox.uid_slots = UID_BASE, UID_SLOTS  # see test_sandbox: our own stray range
    return env


def test_reference_solutions_score_one_and_wrong_ones_zero(env):
    for task in itertools.islice(env.tasks("heldout"), 3):
        name = task.info["entry_point"]
        wrong = block(f"def {name}(*args):\n    return None\n")
        scores = env.score_details(task, [env.demonstration(task), wrong, "I don't know."])
        assert [s.reward for s in scores] == [1.0, 0.0, 0.0]
        assert scores[0].metrics["code/tests_passed"] == scores[0].metrics["code/tests_total"] == 5
        assert scores[0].isolation == env.sandbox.isolation
        assert scores[0].metrics["code/isolation_bwrap"] == float(env.sandbox.isolation == "bwrap")
        assert scores[0].metrics["code/cgroup"] == float(cgroup.probe()[0] is not None)
        assert scores[0].metrics["code/memory_limit"] == 0.0 and "code/own_network" in scores[0].metrics
        assert scores[0].metrics["code/own_mounts"] == float(env.sandbox.own_mounts)
        assert scores[2].metrics["code/no_code"] == 1.0


def test_partial_solutions_score_the_fraction_passed(env):
    task = next(iter(env.tasks("heldout")))
    tests, name = task.info["tests"], task.info["entry_point"]
    known = {json.dumps(t["args"]): t["expected"] for t in tests[:2]}
    lookup = block(f"import json\nKNOWN = {known!r}\ndef {name}(*args):\n    return KNOWN[json.dumps(list(args))]\n")
    # hangs on the third test only: the per-test budget stops it and the other four still count
    hang = json.dumps(tests[2]["args"])
    correct = task.info["reference"]
    hanging = block(f"import json\n{correct}\n_ok = {name}\ndef {name}(*args):\n"
                    f"    while json.dumps(list(args)) == {hang!r}:\n        pass\n    return _ok(*args)\n")
    lookup_s, hang_s = env.score_details(task, [lookup, hanging])
    assert lookup_s.reward == pytest.approx(2 / 5) and lookup_s.metrics["code/errors"] == 3
    assert hang_s.reward == pytest.approx(4 / 5) and hang_s.metrics["code/timeouts"] == 1
    assert env.score(task, []) == []


# Forks 8 children that each write 64 MB (under each one's 256 MB address-space limit), waits until all hold it, then
# ends them: 512 MB in all, twice the run's cap (CodeEnv's memory_mb, below) and nothing to this machine.
FORKING_MEMORY = """import os, time
def _fork_memory():
    r, w = os.pipe()
    kids = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            try:
                block = b"x" * (64 << 20)
                os.write(w, b"1")
                time.sleep(60)
            finally:
                os._exit(0)
        kids.append(pid)
    os.close(w)
    got = b""
    while len(got) < 8 and (chunk := os.read(r, 8)):
        got += chunk
    for pid in kids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    os.close(r)
    return len(got)
"""


def hostile_solutions(name: str, reference: str, tag: str, port: int) -> dict[str, str]:
    """Each attempts an escape and, where it could, answers correctly only if the escape worked: contained, the
    attempt fails and the solution scores 0 (so a 0 here shows containment, not a wrong answer). `port`: a listener
    on the host's loopback, started by the test."""
    def gated(attempt: str) -> str:
        return f"{reference}\n_ok = {name}\ndef {name}(*args):\n    {attempt}\n    return _ok(*args)\n"

    return {
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "infinite_loop": f"def {name}(*args):\n    while True:\n        pass\n",
        "memory_bomb": gated("x = [bytearray(10 ** 7) for _ in range(10 ** 4)]"),
        "network": "import socket\n" + gated(f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()"),
        "write_outside": gated(f"[open(d + '/evil-{tag}', 'w').write('x') for d in ('/root', '/work')]"),
        "env_secret": "import os\n" + gated("os.environ['ASTRATK_TEST_SECRET']"),
        "huge_output": "import os, sys\nwhile True:\n    print('x' * 4096)\n    os.write(1, b'y' * 4096)\n"
                       "    os.write(2, b'z' * 4096)\n",
        "forged_results": "import os\nfor fd in range(3, 12):\n    for i in range(5):\n        try:\n"
                           "            os.write(fd, ('@@x@@ {\"i\": %d, \"status\": \"ok\"}\\n' % i).encode())\n"
                           "        except OSError:\n            pass\n",
    }


def test_hostile_solutions_score_zero_and_leave_the_host_alone(env, monkeypatch):
    monkeypatch.setenv("ASTRATK_TEST_SECRET", "hunter2")
    task = next(iter(env.tasks("heldout")))
    tag = uuid.uuid4().hex
    with socket.socket() as server:  # a host service the sandbox must not reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        programs = hostile_solutions(task.info["entry_point"], task.info["reference"], tag, port)
        harmless = programs["network"].replace(f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()",
                                               "socket.gethostname()")
        assert env.grade(task, block(harmless)) == 1.0  # the gate passes when the attempt succeeds
        if not env.sandbox.netns:
            programs.pop("network")  # the host's network (process mode without namespaces); results say so
        if not ROOT:
            programs.pop("fork_bomb")  # no uid to drop to: only the wall clock would stop it (test_sandbox skips too)
        scores = env.score_details(task, [block(code) for code in programs.values()])
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever arrived
    assert {k: s.reward for k, s in zip(programs, scores)} == dict.fromkeys(programs, 0.0)
    assert all(s.metrics["code/infra_error"] == 0.0 for s in scores)
    assert not any(os.path.exists(f"{d}/evil-{tag}") for d in ("/root", "/work", "/tmp"))
    host_is_fine()


def test_forking_memory_bomb_scores_zero_because_of_the_run_cap(env):
    """Its own envs: a 5 s per-test budget, so only memory can stop it. Under the run's 256 MB cap it scores 0; with a
    1.5 GB cap it allocates everything and scores 1, so the 0 is the cap's doing."""
    need_cgroup()
    task = next(iter(env.tasks("heldout")))
    name, reference = task.info["entry_point"], task.info["reference"]
    code = block(f"{FORKING_MEMORY}{reference}\n_ok = {name}\ndef {name}(*args):\n"
                 f"    assert _fork_memory() == 8\n    return _ok(*args)\n")
    rewards = []
    for run_memory_mb in (None, 1536):
        capped = CodeEnv(levels=(1, 2, 3), n_heldout=6, seed=3, test_timeout_s=5.0, isolation=env.sandbox.isolation,
                         memory_mb=256, max_procs=16, run_memory_mb=run_memory_mb)
        capped.sandbox.uid_base, capped.sandbox.uid_slots = UID_BASE, UID_SLOTS
        [score] = capped.score_details(task, [code])
        assert score.metrics["code/infra_error"] == 0.0
        rewards.append(score.reward)
        host_is_fine()
    assert rewards == [0.0, 1.0]


def test_rollout_then_score(env):
    tok = build_char_tokenizer()
    task = next(iter(env.tasks("heldout")))
    answer = list(tok(env.demonstration(task), add_special_tokens=False)["input_ids"])
    engine = ScriptedEngine(tok, [answer + [tok.convert_tokens_to_ids("<|im_end|>")]])
    [traj] = asyncio.run(env.rollout(task, {"policy": engine}, SamplingParams(max_tokens=2000), policy_ids={
        "policy": "solver"}, group_id="g/0"))
    assert traj.finished and traj.policy_id == "solver" and traj.text == env.demonstration(task)
    assert env.score(task, [traj, traj]) == [1.0, 1.0]


def test_sandbox_failure_is_none_not_zero():
    env = CodeEnv(n_heldout=1, seed=0, memory_mb=1, test_timeout_s=1.0)  # too little memory to start Python
    task = next(iter(env.tasks("heldout")))
    [score] = env.score_details(task, [env.demonstration(task)])
    assert score.reward is None and score.metrics["code/infra_error"] == 1.0


def test_extract_code():
    assert extract_code("```python\ndef f():\n    return 1\n```") == "def f():\n    return 1\n"
    two = "```python\ndef f(x):\n    return x\n```\nUsage:\n```python\nprint(f(1))\n```"
    assert extract_code(two, "f").startswith("def f(x)")  # the block that defines the entry point
    assert extract_code(two) == "print(f(1))\n"  # otherwise the last one
    assert extract_code("```py\nx = 1") == "x = 1"  # cut off by the token budget
    assert extract_code("def f():\n    return 2\n") == "def f():\n    return 2\n"  # no fences, valid Python
    assert extract_code("The answer is f(x) = 2x.") is None
    assert solution_code("```python\n    return a + b\n```", "add", "def add(a, b):\n") == \
        "def add(a, b):\n    return a + b\n"


# ------------------------------------------------------------------------------------------------------ files
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n',
     "canonical_solution": "    return a + b\n", "entry_point": "add",
     "test": "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
             "    assert candidate(-1, 1) == 0\n    assert candidate(2, 2) == 4\n"},
    {"task_id": "HumanEval/1", "prompt": "def evens(xs):\n", "canonical_solution": "    return xs[::2]\n",
     "entry_point": "evens",
     "test": "def check(candidate):\n    for n in range(3):\n        assert candidate(list(range(n))) == "
             "list(range(0, n, 2))\n"},
]
MBPP = [{"task_id": 11, "text": "Write a function to square a number.", "code": "def square(n):\n    return n * n",
         "test_list": ["assert square(2) == 4", "assert square(3) == 9", "assert square(-1) == 1"],
         "test_setup_code": ""}]


def packed(cases: list[dict]) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LCB = [
    {"question_id": "abc001_a", "question_content": "Read two integers and print their sum.",
     "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
     "private_test_cases": packed([{"input": "10 -3\n", "output": "7\n", "testtype": "stdin"},
                                   {"input": "0.5 0.25\n", "output": "0.75\n", "testtype": "stdin"}]),
     "starter_code": "", "metadata": "{}"},
    {"question_id": "lc1", "question_content": "Return the largest number.", "private_test_cases": [],
     "public_test_cases": [{"input": "[1, 5, 2]", "output": "5", "testtype": "functional"},
                           {"input": "[-1]", "output": "-1", "testtype": "functional"}],
     "starter_code": "class Solution:\n    def maxOf(self, nums):\n        ", "metadata": {"func_name": "maxOf"}},
]


def write_jsonl(path, rows, extra: str = "") -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra)
    return str(path)


def test_loaders_read_the_three_formats(tmp_path):
    he = load_problems(write_jsonl(tmp_path / "he.jsonl", HUMANEVAL))
    assert [p.problem_id for p in he] == ["HumanEval/0", "HumanEval/1"]
    assert len(he[0].tests) == 3 and len(he[1].tests) == 1  # asserts split; a loop body stays one test
    [mbpp] = load_problems(write_jsonl(tmp_path / "mbpp.jsonl", MBPP))
    assert (mbpp.entry_point, len(mbpp.tests)) == ("square", 3)
    lcb = load_problems(write_jsonl(tmp_path / "lcb.jsonl", LCB))
    assert [t["kind"] for t in lcb[0].tests] == ["stdio"] * 3 and lcb[0].entry_point is None
    assert lcb[1].tests[0] == {"kind": "call", "fn": "maxOf", "args": [[1, 5, 2]], "expected": 5}


def test_file_problems_score_in_the_sandbox(tmp_path):
    rows = HUMANEVAL + MBPP + LCB
    env = CodeEnv(data=write_jsonl(tmp_path / "mixed.jsonl", rows), n_heldout=1, seed=0, test_timeout_s=1.0,
                  max_procs=16)  # 64 x 512 MB would fail the sandbox's RAM guard where no cgroup can be made
    tasks = {t.task_id: t for t in itertools.chain(env.tasks("heldout"), itertools.islice(env.tasks("train"), 4))}
    assert len(tasks) == 5
    he0, he1, mbpp = tasks["code/HumanEval/0"], tasks["code/HumanEval/1"], tasks["code/mbpp/11"]
    stdin_task, functional = tasks["code/livecodebench/abc001_a"], tasks["code/livecodebench/lc1"]
    rewards = [s.reward for s in env.score_details(he0, [
        env.demonstration(he0), block("    return a + b"), block("def add(a, b):\n    return a * b\n")])]
    assert rewards == [1.0, 1.0, pytest.approx(1 / 3)]  # full function, body-only continuation, partial
    assert env.grade(he1, env.demonstration(he1)) == 1.0
    assert env.grade(mbpp, block("def square(n):\n    return abs(n) * n\n")) == pytest.approx(2 / 3)
    programs = [block("a, b = map(float, open(0).read().split())\nprint(f'{a + b:g}')"),
                block("import sys\na, b = map(int, sys.stdin.buffer.read().split())\n"
                      "sys.stdout.buffer.write(b'%d\\n' % (a + b))"),
                block("print(int(input().split()[0]) + int(input()))")]
    assert [s.reward for s in env.score_details(stdin_task, programs)] == [1.0, pytest.approx(2 / 3), 0.0]
    assert env.grade(functional, block("class Solution:\n    def maxOf(self, nums):\n        return max(nums)")) == 1.0


@pytest.mark.parametrize(("content", "line", "match"), [
    ("\n\n{not json\n", 3, "invalid JSON"),
    (json.dumps(MBPP[0]).encode() + b"\n\xff\xfe\n", 2, "not UTF-8"),
    (json.dumps(HUMANEVAL[0]) + "\n[1, 2]\n", 2, "expected a JSON object"),
    (json.dumps({"prompt": "x", "test": "y"}) + "\n", 1, "cannot tell the format"),
    (json.dumps(MBPP[0] | {"test_list": []}) + "\n", 1, "test_list"),
    (json.dumps(MBPP[0] | {"test_list": ["assert square(2) =="]}) + "\n", 1, "mbpp problem"),
    (json.dumps(HUMANEVAL[0] | {"test": "assert True"}) + "\n", 1, "check"),
    (json.dumps(HUMANEVAL[0]) + "\n" + json.dumps(HUMANEVAL[0]) + "\n", 2, "duplicate id"),
    (json.dumps(LCB[0] | {"private_test_cases": "%%%"}) + "\n", 1, "private_test_cases"),
    (json.dumps(LCB[0] | {"private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(
        collections.OrderedDict()))).decode()}) + "\n", 1, "refusing to load"),
    (json.dumps(LCB[1] | {"metadata": {}}) + "\n", 1, "func_name"),
    (json.dumps(LCB[0] | {"public_test_cases": [{"input": 1}], "private_test_cases": []}) + "\n", 1, "test case 0"),
])
def test_loaders_reject_malformed_files_with_file_and_line(tmp_path, content, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=match) as e:
        load_problems(path)
    assert str(e.value).startswith(f"{path}:{line}: ")


def test_loaders_reject_empty_files_and_unknown_formats(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl: no problems"):
        load_problems(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="unknown format"):
        load_problems(tmp_path / "empty.jsonl", format="apps")
    with pytest.raises(ValueError, match="too few"):
        CodeEnv(data=write_jsonl(tmp_path / "one.jsonl", MBPP), n_heldout=1)


def test_large_outputs_compare_by_digest(tmp_path):
    big = "\n".join(map(str, range(20000))) + "\n"  # ~110 kB: over the inline limit, so only its SHA-256 returns
    row = {"question_id": "big", "question_content": "Print 0..n-1, one per line.", "private_test_cases": [],
           "public_test_cases": [{"input": "20000\n", "output": big, "testtype": "stdin"},
                                 {"input": "3\n", "output": "0\n1\n2\n", "testtype": "stdin"}]}
    env = CodeEnv(data=write_jsonl(tmp_path / "big.jsonl", [row, LCB[0]]), n_heldout=1, seed=0, max_procs=16)
    task = next(t for t in itertools.chain(env.tasks("heldout"), itertools.islice(env.tasks("train"), 1))
                if t.task_id == "code/livecodebench/big")
    right = block("n = int(input())\nfor i in range(n):\n    print(i, end='  \\n')")  # trailing spaces ignored
    off_by_one = block("n = int(input())\nprint('\\n'.join(map(str, range(n - 1 if n > 3 else n))))")
    assert [s.reward for s in env.score_details(task, [right, off_by_one])] == [1.0, 0.5]
