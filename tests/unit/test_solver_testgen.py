"""Code solver + test-case generator workflow: generator rewards need valid tests that reject a wrong solution of the
solver's group, solvers get the hidden-test fraction, and both run through the real sandbox."""

from __future__ import annotations

import asyncio

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.code.env import CodeEnv
from astratk.envs.workflows.solver_testgen import SolverTestGenEnv, parse_asserts
from astratk.models import build_char_tokenizer

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + [END]


@pytest.fixture(scope="module")
def env():
    return SolverTestGenEnv(CodeEnv(levels=(1,), n_heldout=4, seed=0, test_timeout_s=2.0), n_tests=2)


@pytest.fixture(scope="module")
def task(env):
    return next(t for t in env.tasks("heldout") if t.info["entry_point"] == "add_constant")


def episode(env, task, solver_text: str, generator_text: str, gid: str):
    def script(prompt, params):
        return ids(generator_text if "Do not solve it" in TOK.decode(list(prompt)) else solver_text)

    engine = ScriptedEngine(TOK, script)
    return asyncio.run(env.rollout(task, {"solver": engine, "test_generator": engine}, SamplingParams(max_tokens=400),
                                   policy_ids={"solver": "s", "test_generator": "g"}, group_id=gid))


def test_rewards_follow_the_protocol(env, task):
    fn, right = task.info["entry_point"], env.demonstration(task)
    wrong = f"```python\ndef {fn}(x):\n    return x\n```"
    ref = next(t for t in task.info["tests"] if t["kind"] == "call")
    good = f"assert {fn}({ref['args'][0]}) == {ref['expected']}"  # valid, and rejects `wrong`
    weak = f"assert {fn}(0) == {fn}(0)"  # valid but rejects nothing
    bad = f"assert {fn}(0) == 12345"  # invalid: the reference fails it
    trajs = [*episode(env, task, right, f"```python\n{good}\n{weak}\n```", "l/0"),
             *episode(env, task, wrong, f"```python\n{bad}\n{good}\n```", "l/1"),
             *episode(env, task, wrong, "no tests here", "l/2")]
    scored = env.score_with_metrics(task, trajs)
    rewards = {(t.group_id, t.role): r for t, (r, _) in zip(trajs, scored)}
    assert rewards[("l/0", "solver")] == 1.0 and rewards[("l/1", "solver")] < 1.0
    assert rewards[("l/0", "test_generator")] == 0.5  # good counts, weak rejects nothing
    assert rewards[("l/1", "test_generator")] == 0.5  # bad is invalid, good counts
    assert rewards[("l/2", "test_generator")] == 0.0
    metrics = {(t.group_id, t.role): m for t, (_, m) in zip(trajs, scored)}
    assert metrics[("l/1", "test_generator")]["tests_valid"] == 1.0
    assert metrics[("l/0", "test_generator")]["wrong_solutions_in_group"] == 1.0
    assert metrics[("l/0", "solver")]["code/tests_passed"] == metrics[("l/0", "solver")]["code/tests_total"]


def test_no_wrong_solution_means_no_generator_reward(env, task):
    fn, right = task.info["entry_point"], env.demonstration(task)
    ref = next(t for t in task.info["tests"] if t["kind"] == "call")
    good = f"assert {fn}({ref['args'][0]}) == {ref['expected']}"
    trajs = episode(env, task, right, f"```python\n{good}\n```", "l/0")
    assert env.score(task, trajs) == [1.0, 0.0]


def test_parse_asserts_and_demonstrations(env, task):
    text = "```python\nassert f(1) == 2\nassert f(1) == 2\nassert f(\nprint(3)\nassert g(2)\nassert h(3)\n```"
    assert parse_asserts(text, 2) == ["assert f(1) == 2", "assert g(2)"]
    assert parse_asserts("assert x\nassert y", 5) == ["assert x", "assert y"]
    (_, solution), (gen_msgs, tests) = env.demonstrations(task)
    assert env.grade(task, solution) == 1.0 and "Do not solve it" in gen_msgs[0]["content"]
    asserts = parse_asserts(tests, 2)
    assert len(asserts) == 2
    trajs = episode(env, task, f"```python\ndef {task.info['entry_point']}(x):\n    return 0\n```", tests, "l/0")
    assert env.score(task, trajs)[1] == 1.0  # the demonstrated tests are valid and catch a wrong solution
