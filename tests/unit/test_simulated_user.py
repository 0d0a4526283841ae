"""Simulated-user env: scripted agent and user play whole episodes (ask, answer, submit); the user's text is masked in
the agent's trajectory and trainable in the user's own; each ending (submission, stop word, turn and context limits)
is counted once; rewards follow the normalised goal; splits are deterministic and disjoint; bad rows and budgets
raise naming the column or key; demonstrations are the episode the env plays; the short name resolves."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import pickle
import re

import pytest

from astratk.config import dump_spec, load_spec
from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.multiturn import encode_chat
from astratk.envs.simulated_user import (
    KINDS,
    STOP_WORD,
    SimulatedUserEnv,
    normalize_value,
    submitted_value,
)
from astratk.models import build_char_tokenizer
from astratk.registry import resolve

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
SAMPLING = SamplingParams(temperature=1.0, max_tokens=120, seed=11)
ENDINGS = ("submitted", "user_stopped", "turn_limit", "context_limit")
ROWS = [{"instructions": f"Your code is C{i}. Give it when asked.", "goal": f"C{i}", "opening": "Hi, I need help."}
        for i in range(6)]


def said(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + [END]


def agent_script(*turns):
    """The agent's k-th turn says turns[k] (the last repeated); a callable turn gets the prompt's text."""
    def script(prompt_ids, params):
        text = TOK.decode(list(prompt_ids))
        turn = turns[min(text.count("<|im_start|>assistant") - 1, len(turns) - 1)]
        return said(turn(text) if callable(turn) else turn)
    return script


def reads_order_number(text: str) -> str:
    """A second agent turn that submits the order number it read in the user's last message."""
    return "<submit>" + re.findall(r"#W\d+", text)[-1] + "</submit>"


def play(env, task, agent_turns, user_replies, policy_ids=None):
    agent = ScriptedEngine(TOK, agent_script(*agent_turns))
    user = ScriptedEngine(TOK, [said(r) for r in user_replies])
    ids = policy_ids or {"agent": "policy", "user": "frozen-user"}
    trajs = asyncio.run(env.rollout(task, {"agent": agent, "user": user}, SAMPLING, policy_ids=ids, group_id="g/0"))
    return trajs, env.score(task, trajs), agent, user


def segments(traj):
    """The completion as (mask, text) runs: what the role wrote (1) and what the env appended (0)."""
    out = []
    for m, group in itertools.groupby(zip(traj.loss_mask, traj.completion, strict=True), key=lambda x: x[0]):
        out.append((m, TOK.decode([t for _, t in group])))
    return out


def ending(traj):
    assert sum(traj.metrics[k] for k in ENDINGS) == 1.0  # exactly one way to end
    return next(k for k in ENDINGS if traj.metrics[k])


@pytest.fixture(scope="module")
def env():
    return SimulatedUserEnv(n_heldout=8, seed=3, kinds=["order_status"])


@pytest.fixture(scope="module")
def task(env):
    return next(iter(env.tasks("heldout")))


# --------------------------------------------------------------------------------------------------------- episodes


def test_agent_asks_user_answers_agent_submits(env, task):
    (agent, user), rewards, agent_engine, user_engine = play(
        env, task, ["What is your order number?", reads_order_number], [task.info["answer"]])
    assert rewards == [1.0, 1.0]  # the cooperative user gets the agent's reward
    assert (agent.role, agent.policy_id, user.role, user.policy_id) == ("agent", "policy", "user", "frozen-user")
    assert [m for m, _ in segments(agent)] == [1, 0, 1]
    assert task.info["answer"] in segments(agent)[1][1]  # the user's reply is context: loss mask 0, version -1
    assert all(v == -1 for v, m in zip(agent.behavior_versions, agent.loss_mask, strict=True) if not m)
    assert ending(agent) == "submitted" and agent.metrics["turns"] == 2 and agent.metrics["correct"] == 1.0
    assert agent.metrics["user_turns"] == 1 and agent.metrics["user_tokens"] == len(said(task.info["answer"]))
    assert agent.metrics["user_gave_goal"] == 1.0  # the user's reply held the order number
    # the user's own trajectory: its reply trainable, its hidden instructions in its prompt only
    assert [(m, t) for m, t in segments(user)] == [(1, task.info["answer"] + "<|im_end|>")]
    assert task.info["instructions"] in TOK.decode(list(user.tokens[:user.n_prompt]))
    assert all(task.info["instructions"] not in TOK.decode(list(r.prompt_ids)) for r in agent_engine.requests)
    [request] = user_engine.requests  # the user sees the agent's question as a user message, greedy by default
    assert "What is your order number?" in TOK.decode(list(request.prompt_ids)) and STOP_WORD in TOK.decode(
        list(request.prompt_ids))
    assert request.params.temperature == 0.0 and request.params.stop == (STOP_WORD,)
    assert request.params.max_tokens == env.user_max_tokens
    assert all("</submit>" in r.params.stop and r.params.temperature == 1.0 for r in agent_engine.requests)


def test_a_wrong_value_scores_zero_and_values_normalise(env, task):
    (agent, _), rewards, *_ = play(env, task, ["Order number?", "<submit>#W0000000</submit>"], ["#W1"])
    assert rewards == [0.0, 0.0] and ending(agent) == "submitted" and agent.metrics["correct"] == 0.0
    goal = task.info["goal"]
    assert env.grade(task, f"Thanks! <submit>  {goal.lower().lstrip('#')}. </submit>") == 1.0
    assert env.grade(task, f"The number is {goal}.") == 0.0  # no submission
    assert normalize_value(" #W12,  Main St. ") == "w12 main st" and submitted_value("<submit></submit>") is None


def test_the_user_ends_the_episode_with_the_stop_word(env, task):
    (agent, user), rewards, *_ = play(env, task, ["Anything else?"], [f"No, that's all. {STOP_WORD}"])
    assert ending(agent) == "user_stopped" and rewards == [0.0, 0.0] and agent.metrics["user_gave_goal"] == 0.0
    assert agent.metrics["turns"] == 1 and agent.metrics["user_turns"] == 1
    assert [m for m, _ in segments(agent)] == [1]  # the agent never sees the stop message
    assert STOP_WORD in user.text


def test_the_turn_limit_ends_and_is_counted(task):
    env = SimulatedUserEnv(n_heldout=8, seed=3, kinds=["order_status"], max_turns=3)
    (agent, user), rewards, _, user_engine = play(env, task, ["Hmm?"], ["I told you."])
    assert ending(agent) == "turn_limit" and rewards == [0.0, 0.0]
    assert agent.metrics["turns"] == 3 and agent.metrics["user_turns"] == 2 == len(user_engine.requests)
    assert [m for m, _ in segments(agent)] == [1, 0, 1, 0, 1] and [m for m, _ in segments(user)] == [1, 0, 1]


def test_the_context_limit_ends_the_episode():
    env = SimulatedUserEnv(rows=ROWS, n_heldout=1, user_prompt="{instructions}", greeting="Hi")
    task = next(iter(env.tasks("heldout")))
    room = len(encode_chat(TOK, env.messages(task))) + 30
    small = SimulatedUserEnv(rows=ROWS, n_heldout=1, user_prompt="{instructions}", greeting="Hi", max_context=room,
                             user_max_tokens=20)
    (agent, user), rewards, *_ = play(small, task, ["?"], ["x" * 60])
    assert ending(agent) == "context_limit" and agent.metrics["context_exhausted"] == 1.0 and rewards == [0.0, 0.0]
    assert len(agent.tokens) == room

    # the user's side: its prompt does not fit, so it never speaks and its trajectory gets no reward
    tight = SimulatedUserEnv(rows=ROWS, n_heldout=1, max_context=room, user_max_tokens=20)
    (agent, user), rewards, _, user_engine = play(tight, task, ["?"], ["never said"])
    assert ending(agent) == "context_limit" and not user_engine.requests
    assert rewards == [0.0, None] and user.n_prompt == len(user.tokens) and user.metrics["turns"] == 0


def test_an_immediate_submission_leaves_the_user_nothing_to_train(env, task):
    (agent, _), rewards, _, user_engine = play(env, task, [f"<submit>{task.info['goal']}</submit>"], ["unused"])
    assert rewards == [1.0, None] and not user_engine.requests and agent.metrics["user_turns"] == 0


def test_the_user_model_writes_a_missing_opening():
    rows = [{k: v for k, v in r.items() if k != "opening"} for r in ROWS]
    env = SimulatedUserEnv(rows=rows, n_heldout=1, user_temperature=None)
    task = next(iter(env.tasks("heldout")))
    (agent, user), rewards, agent_engine, user_engine = play(
        env, task, ["Your code?", lambda text: "<submit>" + re.findall(r"C\d", text)[-1] + "</submit>"],
        ["Hello, my order is stuck.", f"It is {task.info['goal']}."])
    assert rewards == [1.0, 1.0] and agent.metrics["user_turns"] == 2
    assert "Hello, my order is stuck." in TOK.decode(list(agent_engine.requests[0].prompt_ids))
    assert env.greeting in TOK.decode(list(user_engine.requests[0].prompt_ids))
    assert user_engine.requests[0].params.temperature == SAMPLING.temperature  # None: the run's temperature
    assert [m for m, _ in segments(user)] == [1, 0, 1]
    with pytest.raises(NotImplementedError, match="opening"):
        env.messages(task)


def test_a_written_stop_in_the_opening_ends_before_the_agent_speaks():
    rows = [{k: v for k, v in r.items() if k != "opening"} for r in ROWS]
    env = SimulatedUserEnv(rows=rows, n_heldout=1)
    task = next(iter(env.tasks("heldout")))
    (agent, _), rewards, agent_engine, _ = play(env, task, ["unused"], [STOP_WORD])
    assert ending(agent) == "user_stopped" and not agent_engine.requests and rewards == [None, 0.0]


# ------------------------------------------------------------------------------------------------- warm starts


def test_demonstrations_are_the_episode_the_env_plays(task):
    env = SimulatedUserEnv(n_heldout=8, seed=3, kinds=["order_status"], demonstrate_user=True)
    assert env.multi_turn
    (ask_msgs, ask), (seen, submit), (user_msgs, answer) = env.demonstrations(task)
    assert env.grade(task, submit) == 1.0 and answer == task.info["answer"] and ask == env.demonstration(task)
    _, rewards, agent_engine, user_engine = play(env, task, [ask, submit], [answer])
    assert rewards == [1.0, 1.0]
    assert [list(r.prompt_ids) for r in agent_engine.requests] == [encode_chat(TOK, ask_msgs), encode_chat(TOK, seen)]
    assert [list(r.prompt_ids) for r in user_engine.requests] == [encode_chat(TOK, user_msgs)]


# ----------------------------------------------------------------------------------------------------- tasks


def test_splits_are_deterministic_and_disjoint(env):
    heldout = list(env.tasks("heldout"))
    assert len(heldout) == 8 and len({t.task_id for t in heldout}) == 8
    assert heldout == list(SimulatedUserEnv(n_heldout=8, seed=3, kinds=["order_status"]).tasks("heldout"))
    assert heldout != list(SimulatedUserEnv(n_heldout=8, seed=4, kinds=["order_status"]).tasks("heldout"))
    train = list(itertools.islice(env.tasks("train"), 300))
    assert train == list(itertools.islice(env.tasks("train"), 300))
    key = lambda t: (t.info["instructions"], t.info["goal"])
    assert {key(t) for t in heldout}.isdisjoint(key(t) for t in train)
    assert all(t.split == "train" for t in train) and all(t.split == "heldout" for t in heldout)
    everything = SimulatedUserEnv(n_heldout=40)
    assert {t.info["kind"] for t in everything.tasks("heldout")} == set(KINDS)
    assert all(t.info["goal"] in t.info["instructions"] for t in everything.tasks("heldout"))  # the user knows it
    assert list(pickle.loads(pickle.dumps(env)).tasks("heldout")) == heldout


def test_user_rows_from_a_list_or_a_jsonl_file(tmp_path):
    env = SimulatedUserEnv(rows=ROWS, n_heldout=2, seed=1)
    heldout, train = list(env.tasks("heldout")), list(itertools.islice(env.tasks("train"), 8))
    assert len(heldout) == 2 and {t.info["goal"] for t in train[:4]} | {t.info["goal"] for t in heldout} == {
        r["goal"] for r in ROWS}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({**r, "id": f"r{i}"}) for i, r in enumerate(ROWS)) + "\n")
    from_file = SimulatedUserEnv(rows=str(path), heldout_rows=[ROWS[0]], n_heldout=1)
    assert [t.info["goal"] for t in from_file.tasks("heldout")] == ["C0"]
    assert sorted(t.task_id for t in itertools.islice(from_file.tasks("train"), 5)) == [
        f"simulated_user/train/r{i}" for i in range(1, 6)]  # the held-out row is left out of training
    task = next(from_file.tasks("train"))
    assert task.info["target"] and task.info["answer"] == f"It is {task.info['goal']}."


@pytest.mark.parametrize(("rows", "message"), [
    ([{"goal": "7", "opening": "Hi"}], r"rows row 6: no 'instructions' column"),
    ([{"instructions": "You know 7."}], r"rows row 6: no 'goal' column"),
    ([{"instructions": "You know 7.", "goal": "  "}], r"rows row 6: 'goal' is empty"),
    ([{"instructions": "You know 7.", "goal": "?!"}], r"'goal' is empty \(or only punctuation\)"),
    ([{"instructions": "", "goal": "7"}], r"'instructions' must be a non-empty string"),
    ([{"instructions": "You know 7.", "goal": "7", "opening": ""}], r"'opening' must be a non-empty string"),
    (["not a dict"], r"rows row 6: expected a dict"),
])
def test_bad_rows_name_the_column(rows, message):
    with pytest.raises(ValueError, match=message):
        SimulatedUserEnv(rows=[*ROWS, *rows], n_heldout=1)


def test_bad_files_name_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"instructions": "x"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: no 'goal' column")):
        SimulatedUserEnv(rows=str(path), n_heldout=1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_turns": 1}, r"max_turns must be >= 2"),
    ({"max_context": 64, "user_max_tokens": 64}, r"max_context \(64\) must be larger than user_max_tokens"),
    ({"max_env_tokens": 0}, r"max_env_tokens must be >= 1"),
    ({"max_tokens_per_turn": 0}, r"max_tokens_per_turn must be >= 1"),
    ({"user_temperature": -1.0}, r"user_temperature must be >= 0"),
    ({"stop_word": ""}, r"stop_word must be a non-empty string"),
    ({"kinds": ["weather"]}, r"kinds: unknown task kind 'weather'"),
    ({"n_heldout": 0}, r"n_heldout must be"),
    ({"user_prompt": "Be a customer."}, r"user_prompt must contain \{instructions\}"),
    ({"agent_prompt": "Find {what}."}, r"agent_prompt: cannot fill the template"),
    ({"rows": ROWS, "n_heldout": 6}, r"n_heldout=6 leave none to train on; lower n_heldout or give heldout_rows"),
    ({"heldout_rows": ROWS}, r"heldout_rows needs rows"),
])
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimulatedUserEnv(**kwargs)


def test_score_refuses_an_unknown_role(env, task):
    (agent, _), *_ = play(env, task, ["<submit>x</submit>"], ["unused"])
    with pytest.raises(ValueError, match="unknown role 'policy'"):
        env.score(task, [dataclasses.replace(agent, role="policy")])


def test_the_short_name_and_the_config_build_the_env(tmp_path):
    assert resolve("env", "simulated_user") is SimulatedUserEnv
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"env": {"class_path": "simulated_user", "init_args": {
        "n_heldout": 5, "kinds": ["refund"], "user_temperature": None, "max_turns": 4}},
        "policies": [{"policy_id": "main", "roles": ["agent", "user"]}]}))  # one trained policy plays both roles
    spec = load_spec(path)
    assert isinstance(spec.env, SimulatedUserEnv) and spec.env.roles == ("agent", "user")
    assert spec.env.user_temperature is None and spec.env.kinds == ("refund",) and spec.env.max_turns == 4
    path.write_text(dump_spec(spec))
    assert list(load_spec(path).env.tasks("heldout")) == list(spec.env.tasks("heldout"))



def test_the_envs_advice_names_a_user_that_keeps_the_value_back(env):
    refuses = {"agent/user_gave_goal": 0.06, "agent/user_turns": 2.5, "agent/correct": 0.0}
    [line] = env.signal_advice(refuses)
    assert "the user gave the value in 6% of episodes (2.5 replies each)" in line and "temperature: 1.0" in line
    [line] = env.signal_advice({**refuses, "agent/user_gave_goal": 0.5, "agent/correct": 0.1})
    assert "the agent submitted it right in 10%" in line and "model.warm_start" in line
    assert env.signal_advice({**refuses, "agent/user_gave_goal": 0.5, "agent/correct": 0.4}) == []
    assert env.signal_advice({**refuses, "agent/user_turns": 0.0}) == [] and env.signal_advice({}) == []
