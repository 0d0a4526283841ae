"""The judged workflow: a train answer is rewarded by the judge's verdict only (an unreadable verdict gives no reward),
a held-out one by the ground truth the judge never sees; the metrics show where the judge and the truth part."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows import JudgedEnv
from astratk.models import build_char_tokenizer
from astratk.registry import resolve_path

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + [END]


def engines(answer: str, verdict: str) -> tuple[dict[str, ScriptedEngine], list[str]]:
    seen: list[str] = []

    def judge(prompt, params):
        seen.append(TOK.decode(list(prompt)))
        assert params.temperature == 0.0 and params.max_tokens == 16
        return ids(verdict)

    return {"policy": ScriptedEngine(TOK, [ids(answer)]), "judge": ScriptedEngine(TOK, judge)}, seen


def episode(env, task, answer: str, verdict: str):
    e, seen = engines(answer, verdict)
    trajs = asyncio.run(env.rollout(task, e, SamplingParams(temperature=1.0, max_tokens=16, seed=3),
                                    policy_ids={"policy": "main", "judge": "grader"}, group_id="L1/0"))
    return trajs, seen


@pytest.fixture(scope="module")
def env():
    return JudgedEnv(ArithmeticEnv(levels=[1], n_heldout=4))


def test_a_train_answer_gets_the_judges_verdict_even_when_it_is_wrong(env):
    task = next(iter(env.tasks("train")))
    wrong = str(int(task.info["answer"]) + 1)
    (policy, judge), seen = episode(env, task, wrong, "Yes, that is correct.")
    assert policy.role == "policy" and judge.role == "judge" and judge.policy_id == "grader"
    assert f"Proposed answer:\n{wrong}" in seen[0] and task.info["answer"] not in seen[0].split("Question:")[0]
    assert policy.metrics["ground_truth"] == 0.0 and policy.metrics["judge_verdict"] == 1.0
    assert policy.metrics["judge_agrees"] == 0.0  # the judge was gamed here, and the metrics say so
    assert env.score(task, [policy, judge]) == [1.0, 0.0]  # trained on the verdict; the judge disagreed with truth


def test_a_held_out_answer_is_scored_by_the_ground_truth(env):
    task = next(iter(env.tasks("heldout")))
    (policy, judge), _ = episode(env, task, task.info["answer"], "No.")
    assert task.split == "heldout"
    assert env.score(task, [policy, judge]) == [1.0, 0.0]  # right whatever the judge said


def test_an_unreadable_verdict_gives_no_reward_and_is_counted(env):
    task = next(iter(env.tasks("train")))
    (policy, judge), _ = episode(env, task, task.info["answer"], "Hmm, let me think about it")
    assert policy.metrics["judge_unparseable"] == 1.0 and policy.metrics["judge_verdict"] == -1.0
    assert env.score(task, [policy, judge]) == [None, None]


def test_a_score_judge_and_reference_fields(env):
    task = next(iter(env.tasks("train")))
    scored = JudgedEnv(ArithmeticEnv(levels=[1]), template="Q: {prompt} A: {completion} Reference: {answer}. Score "
                       "0-10.", parse="score")
    (policy, _), seen = episode(scored, task, task.info["answer"], "Score: 8")
    assert f"Reference: {task.info['answer']}." in seen[0]
    assert policy.metrics["judge_verdict"] == pytest.approx(0.8) and policy.metrics["judge_agrees"] == 1.0
    missing = JudgedEnv(ArithmeticEnv(levels=[1]), template="{completion} {rubric}")
    with pytest.raises(ValueError, match=r"names \['rubric'\], which task"):
        missing.judge_messages(task, "3")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"template": "Is {prompt} right?"}, "must name {completion}"),
    ({"template": "{completion} {"}, "does not parse"),
    ({"parse": "stars"}, "parse is 'score', 'verdict'"),
    ({"judge_max_tokens": 0}, "judge_max_tokens >= 1"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JudgedEnv(ArithmeticEnv(levels=[1]), **kwargs)


def test_the_short_name_and_the_warm_start_teach_the_policy_only(env):
    assert resolve_path("env", "judged") == "astratk.envs.workflows.judged.JudgedEnv"
    task = next(iter(env.tasks("train")))
    [(messages, answer)] = env.demonstrations(task)
    assert messages == env.messages(task) and answer == env.demonstration(task)
    assert dataclasses.replace(task, split="heldout").split == "heldout"


def test_the_envs_advice_names_a_judge_that_gives_no_signal(env):
    from astratk.dataflow.learning_signal import SignalReading, describe, env_advice, trajectory_means

    says_no = {"policy/judge_unparseable": 0.0, "policy/judge_verdict": 0.008, "policy/judge_agrees": 0.6,
               "policy/ground_truth": 0.4}
    [line] = env.signal_advice(says_no)
    assert "same verdict to nearly every answer" in line and "mean verdict 0.008" in line and "60%" in line
    unread = env.signal_advice({**says_no, "policy/judge_unparseable": 0.7, "policy/judge_verdict": -0.7})
    assert "70% of the judge's replies could not be read" in unread[0]
    # unreadable replies count -1 in the verdict mean: 20% unreadable and the rest all yes reads as a mean of 0.6
    assert env.signal_advice({**says_no, "policy/judge_unparseable": 0.2, "policy/judge_verdict": 0.6})[0].count(
        "mean verdict 1.000") == 1
    gamed = {"policy/judge_unparseable": 0.0, "policy/judge_verdict": 0.5, "policy/judge_agrees": 0.5,
             "policy/ground_truth": 0.3}
    assert "poor guide" in env.signal_advice(gamed)[0]
    assert env.signal_advice({**gamed, "policy/judge_agrees": 0.9}) == [] and env.signal_advice({}) == []
    # as the run's starvation line and the probe read it: from the data layer's means, first in the advice
    metrics = {f"data/main/traj/{k}_mean": v for k, v in says_no.items()} | {"data/main/groups_received": 4.0}
    reading = SignalReading(groups=16, admitted=1, dropped={"zero_variance": 15.0}, samples=128, reward_mean=0.008,
                            env_advice=env_advice(env, trajectory_means(metrics, "main")))
    line = describe(reading, group_size=8, temperature=0.7, max_new_tokens=32)
    assert line.index("same verdict to nearly every answer") < line.index("larger rollout.group_size")

    class Broken:
        def signal_advice(self, means):
            raise RuntimeError("a bug in a user's env")

    assert env_advice(Broken(), says_no) == ()  # advice never stops a run
