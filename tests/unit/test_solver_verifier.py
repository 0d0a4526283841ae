"""Math solver + verifier workflow: retry on reject, per-role rewards, masks, warm-start
demonstrations for both roles, and the rollout service scoring both roles of a lease together."""

from __future__ import annotations

import asyncio

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows import SolverVerifierEnv, parse_verdict
from astratk.models import build_char_tokenizer

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + [END]


def scripted(first: str, verdict: str, second: str = "") -> ScriptedEngine:
    """Solver answers `first`, then `second` after a retry prompt; the verifier replies `verdict`."""

    def script(prompt, params):
        text = TOK.decode(list(prompt))
        if "Check:" in text:
            return ids(verdict)
        return ids(second if "Try again" in text else first)

    return ScriptedEngine(TOK, script)


def episode(env, engine, task, max_tokens: int = 16):
    return asyncio.run(env.rollout(task, {"solver": engine, "verifier": engine}, SamplingParams(max_tokens=max_tokens),
                                   policy_ids={"solver": "a", "verifier": "b"}, group_id="lease/0"))


@pytest.fixture(scope="module")
def env():
    return SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))


@pytest.fixture(scope="module")
def task(env):
    return next(iter(env.tasks("train")))


def test_reject_then_correct_retry(env, task):
    right = task.info["answer"]
    wrong = str(int(right) + 1)
    solver, verifier = episode(env, scripted(wrong, "REJECT", right), task)
    assert (solver.role, solver.policy_id, verifier.role, verifier.policy_id) == ("solver", "a", "verifier", "b")
    assert solver.text == right and solver.metrics["retried"] == 1 and solver.metrics["turns"] == 2
    assert env.score(task, [solver, verifier]) == [1.0, 1.0]  # right after the retry; a correct rejection
    mask = solver.loss_mask  # answer (1) / verifier feedback (0) / retried answer (1)
    n1, n2 = len(ids(wrong)), len(ids(right))
    assert mask[:n1] == (1,) * n1 and mask[-n2:] == (1,) * n2 and set(mask[n1:-n2]) == {0}
    assert "REJECT Try again." in TOK.decode(list(solver.tokens))


def test_rewards_per_role_follow_the_protocol(env, task):
    right = task.info["answer"]
    wrong = str(int(right) + 1)
    cases = [  # (first answer, verdict, retry answer) -> (solver reward, verifier reward)
        ((right, "ACCEPT", ""), (1.0, 1.0)),
        ((right, "REJECT", wrong), (0.0, 0.0)),  # wrongly rejected, and the retry went wrong
        ((wrong, "ACCEPT", ""), (0.0, 0.0)),  # wrongly accepted: no retry
        ((wrong, "no idea", ""), (0.0, 0.0)),  # no verdict: verifier wrong, no retry
    ]
    for (first, verdict, second), expected in cases:
        solver, verifier = episode(env, scripted(first, verdict, second), task)
        assert tuple(env.score(task, [solver, verifier])) == expected, (first, verdict, second)
        assert solver.metrics["retried"] == float(verdict == "REJECT")


def test_no_retry_mode_and_verdict_parsing(task):
    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8), retry=False)
    solver, _ = episode(env, scripted("0", "REJECT", "1"), task)
    assert solver.metrics["retried"] == 0 and solver.metrics["turns"] == 1
    assert parse_verdict("I would reject this") == "reject" and parse_verdict("ACCEPTED?") is None
    assert parse_verdict("accept. no, REJECT") == "accept"  # the first verdict word counts
    # other words (a small chat model answers yes or no more readily than ACCEPT or REJECT)
    assert parse_verdict("No, the answer is not correct.", ("yes", "no")) == "reject"
    assert parse_verdict("Yes. It is right", ("yes", "no")) == "accept"
    assert parse_verdict("Nothing to say", ("yes", "no")) is None and parse_verdict("ACCEPT", ("yes", "no")) is None
    with pytest.raises(ValueError, match="verdict_words must be two different words"):
        SolverVerifierEnv(verdict_words=["yes", "YES"])
    env = SolverVerifierEnv(verdict_words=["yes", "no"])
    task = next(iter(env.tasks("train")))
    assert {reply for _, reply in env.demonstrations(task)[1:2]} <= {"yes", "no"}


def test_demonstrations_teach_both_roles(env):
    tasks = list(env.tasks("heldout"))
    verdicts = []
    for t in tasks:
        (solver_msgs, answer), (verifier_msgs, verdict), (retry_msgs, again) = env.demonstrations(t)
        assert again == answer and retry_msgs[-1]["content"] == "REJECT Try again."
        assert retry_msgs[1]["role"] == "assistant" and retry_msgs[1]["content"] != answer
        assert solver_msgs == env.messages(t) and answer == t.info["answer"]
        shown = verifier_msgs[0]["content"].split("Answer: ")[1].split(" Reply")[0]
        assert verdict == ("ACCEPT" if shown == answer else "REJECT")
        verdicts.append(verdict)
    assert set(verdicts) == {"ACCEPT", "REJECT"}


def test_service_scores_both_roles_of_a_lease_with_one_shared_policy(tmp_path):
    """One policy plays both roles: the service routes both, groups per role, scores the lease in one call."""
    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.spec import DataflowSpec, PolicySpec, RolloutSpec, RunSpec

    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    spec = RunSpec(env=env, policies=[PolicySpec(roles=["solver", "verifier"])],
                   rollout=RolloutSpec(engine="scripted", group_size=3, max_new_tokens=8),
                   dataflow=DataflowSpec(filter_zero_variance=False)).validate()
    handle = DataLayerClient(DataLayer(spec))
    service = RolloutService(RunContext("sv", spec, {"main": None}, f"memory://sv-{tmp_path.name}"))
    engine = scripted("0", "REJECT", "0")
    service._engines[("rollout", "main")] = engine  # the scripted engine stands in for the policy's engine
    [res] = service.score(service.rollout(handle.lease(1)))
    by_role = {g.group_id.rsplit("/", 1)[1]: g for g in res.groups}
    assert set(by_role) == {"solver", "verifier"} and all(g.policy_id == "main" for g in res.groups)
    assert all(len(g.trajectories) == 3 for g in res.groups)
    task = res.groups[0].task
    want_verifier = 1.0 if task.info["answer"] != "0" else 0.0  # REJECT is right iff "0" is wrong
    assert [t.reward for t in by_role["verifier"].trajectories] == [want_verifier] * 3
    assert [t.reward for t in by_role["solver"].trajectories] == [float(task.info["answer"] == "0")] * 3


def test_warm_start_batches_hold_both_roles_and_collate_keeps_roles():
    from astratk.models import warm_start as ws

    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    task = next(iter(env.tasks("train")))
    (_, c1), (p2, c2), (p3, _) = ws._examples(TOK, env, task)
    assert TOK.decode(p3).endswith("REJECT Try again.<|im_end|>\n<|im_start|>assistant\n")
    assert TOK.decode(c1) == task.info["answer"] + "<|im_end|>"
    assert TOK.decode(c2) in ("ACCEPT<|im_end|>", "REJECT<|im_end|>") and "Check:" in TOK.decode(p2)


def test_latex_answers_over_a_jsonl_base_graded_off_the_event_loop(tmp_path):
    """A MATH-style base (math-verify grading, LaTeX answers): equivalent forms are right, and the rollout grades the
    judged answer in a worker thread, never on the event loop the episodes share."""
    import json
    import threading

    from astratk.envs.math.jsonl import MathJsonlEnv

    for name, problem in (("train", "Simplify 3/6."), ("test", "Simplify 2/4.")):
        row = {"problem": problem, "solution": "It is $\\boxed{\\frac{1}{2}}$."}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    base = MathJsonlEnv(str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl"), format="math")
    graded_in: list[tuple[str, bool]] = []
    grade = base.grade

    def recording_grade(task, text):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        graded_in.append((threading.current_thread().name, on_loop))
        return grade(task, text)

    base.grade = recording_grade
    env = SolverVerifierEnv(base, max_context=512)
    task = next(iter(env.tasks("heldout")))
    cases = [  # (first answer, verdict, retry answer) -> (solver reward, verifier reward)
        (("\\boxed{\\frac{2}{4}}", "ACCEPT", ""), (1.0, 1.0)),  # equivalent LaTeX: right, rightly accepted
        (("\\boxed{0.5}", "REJECT", "\\boxed{1/3}"), (0.0, 0.0)),  # wrongly rejected, then wrong
        (("\\boxed{\\frac{1}{3}}", "REJECT", "\\boxed{\\tfrac{1}{2}}"), (1.0, 1.0)),
    ]
    try:
        for (first, verdict, second), expected in cases:
            solver, verifier = episode(env, scripted(first, verdict, second), task, max_tokens=32)
            assert tuple(env.score(task, [solver, verifier])) == expected, (first, verdict, second)
    finally:
        base.grader.close()
    rollout_grades = graded_in[::2]  # each case: one grading in the rollout, then the solver's in score()
    assert len(graded_in) == 6 and not any(on_loop for _, on_loop in rollout_grades), graded_in


def _judged(env, task, answers: list[str], verdicts: list[str]):
    """One group: an episode per (first answer, verdict); the verifier trajectories' scores."""
    trajs = []
    for answer, verdict in zip(answers, verdicts, strict=True):
        solver, verifier = episode(env, scripted(answer, verdict, answer), task)
        trajs += [solver, verifier]
    return [sc for sc, t in zip(env.score(task, trajs), trajs, strict=True) if t.role == "verifier"]


def test_balanced_verifier_rewards_average_to_the_groups_balanced_accuracy(task):
    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8), verifier_reward="balanced")
    right = task.info["answer"]
    wrong = str(int(right) + 1)
    answers = [right] * 2 + [wrong] * 6
    # "no" to everything: right 6 times of 8, yet its rewards average 1/2 (every wrong answer caught, no right one)
    always_no = _judged(env, task, answers, ["REJECT"] * 8)
    assert always_no == [0.0, 0.0] + [pytest.approx(8 / 12)] * 6 and sum(always_no) / 8 == pytest.approx(0.5)
    # a right "yes" on the rarer right answer weighs 8 / (2 * 2) = 2; all right averages 1
    perfect = _judged(env, task, answers, ["ACCEPT"] * 2 + ["REJECT"] * 6)
    assert perfect == [2.0, 2.0] + [pytest.approx(8 / 12)] * 6 and sum(perfect) / 8 == pytest.approx(1.0)
    # one class in the group, or one episode (the held-out evaluation scores episodes one by one): plain 1 / 0
    assert _judged(env, task, [wrong] * 3, ["REJECT", "ACCEPT", "REJECT"]) == [1.0, 0.0, 1.0]
    assert _judged(env, task, [right], ["ACCEPT"]) == [1.0]
    # the default stays plain accuracy
    plain = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    assert _judged(plain, task, answers, ["REJECT"] * 8) == [0.0, 0.0] + [1.0] * 6
    with pytest.raises(ValueError, match="verifier_reward must be 'accuracy'"):
        SolverVerifierEnv(verifier_reward="balance")


def test_the_evaluation_reports_the_verifiers_balanced_accuracy(tmp_path):
    """Through the rollout service's held-out evaluation: a verifier that rejects everything is right on the 7 of 8
    tasks whose answer ("0") is wrong, and its balanced accuracy says 1/2."""
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.spec import PolicySpec, RolloutSpec, RunSpec

    env = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8))
    tasks = list(env.tasks("heldout"))
    spec = RunSpec(env=env, policies=[PolicySpec(roles=["solver", "verifier"])],
                   rollout=RolloutSpec(engine="scripted", group_size=3, max_new_tokens=8)).validate()
    service = RolloutService(RunContext("sv", spec, {"main": None}, f"memory://sv-eval-{tmp_path.name}"))
    answer = tasks[0].info["answer"]  # right for the first task only (unless others share it)
    service._engines[("eval", "main")] = scripted(answer, "REJECT", answer)
    r = service.evaluate("main", None, 8)
    right = sum(t.info["answer"] == answer for t in tasks)
    assert r["accuracy_verifier"] == pytest.approx((8 - right) / 8) and r["verdict_accept_rate"] == 0.0
    assert r["balanced_accuracy_verifier"] == pytest.approx(0.5)
