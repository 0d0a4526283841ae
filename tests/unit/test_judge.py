"""Judge: an LLM judge over a real OpenAI-compatible HTTP endpoint (astratk's own, a scripted engine behind it, so
that the judge's replies are known), alone and in FunctionEnv: the request it sends, how it reads verdicts, what an
unreadable reply, a dead or slow or locked endpoint gives (counted, never a hang), and its errors at construction."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from astratk.engines.scripted import ScriptedEngine
from astratk.envs.function import FunctionEnv
from astratk.envs.judge import Judge
from astratk.models.chat import stop_token_ids
from astratk.models.tokenizer import build_char_tokenizer
from astratk.rollout.openai_api import OpenAIEndpoint

pytest.importorskip("aiohttp")

TOK = build_char_tokenizer()
END = stop_token_ids(TOK)[0]
SEEN: list[str] = []


def judge_script(prompt, params):
    """The judge's replies, by what it was asked: a rating, a verdict, or words it cannot be read from."""
    text = TOK.decode(prompt)
    SEEN.append(text)
    if "SLOW" in text:
        time.sleep(3.0)
    reply = ("Score: 8" if "GOOD" in text else "I cannot say" if "WEIRD" in text else
             "yes, it matches" if "RIGHT" in text else "No." if "WRONG" in text else "2")
    return TOK(reply, add_special_tokens=False)["input_ids"] + [END]


@pytest.fixture(scope="module")
def endpoint():
    with OpenAIEndpoint(ScriptedEngine(TOK, judge_script), model="judge", default_max_tokens=32) as ep:
        yield ep


def test_scores_are_read_on_their_scale_and_unreadable_replies_counted(endpoint):
    judge = Judge(endpoint.base_url, "judge", system="You grade answers.")
    SEEN.clear()
    values, metrics = judge.scored(["1+1=", "1+1=", "1+1="], ["a GOOD 2", "3", "WEIRD"])
    assert values == [pytest.approx(0.8), pytest.approx(0.2), None]
    assert [m["judge/judge/unparseable"] for m in metrics] == [0.0, 0.0, 1.0]
    assert all(m["judge/judge/errors"] == 0.0 and m["judge/judge/ms"] > 0 for m in metrics)
    # what the judge was asked: its system message, then the template with the prompt and the completion
    asked = next(t for t in SEEN if "a GOOD 2" in t)
    assert "You grade answers." in asked and "Question:\n1+1=" in asked and "Answer:\na GOOD 2" in asked
    assert judge.read("11") is None and judge.read("-1") is None and judge.read("7.5/10 then 5") == 0.5


def test_verdicts_are_whole_words_and_the_template_takes_dataset_columns(endpoint):
    judge = Judge(endpoint.base_url, "judge", parse="verdict", name="verdict",
                  template="Q: {prompt}\nReference: {answer}\nA: {completion}\nIs A right or wrong?")
    SEEN.clear()
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "capital of France?"}]
    values = judge([chat, chat], [[{"role": "assistant", "content": "Paris (RIGHT)"}], "Lyon (WRONG)"],
                   answer=["Paris", "Paris"])
    assert values == [1.0, 0.0]
    assert any("Q: capital of France?\nReference: Paris\nA: Paris (RIGHT)" in t for t in SEEN)
    assert judge.read("yesterday, maybe") is None and judge.read("NO, it does not") == 0.0
    with pytest.raises(ValueError, match=r"names \['answer'\], which is neither a dataset column"):
        judge(["q"], ["a"])


def test_a_dead_slow_or_locked_endpoint_is_counted_not_hung(endpoint, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = Judge(f"http://127.0.0.1:{port}/v1", "judge", timeout_s=2.0, retries=1, name="dead")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="astratk.envs.judge"):
        values, metrics = dead.scored(["q", "q"], ["a", "b"])
    assert values == [None, None] and time.monotonic() - start < 10
    assert [m["judge/dead/errors"] for m in metrics] == [1.0, 1.0]
    assert [m["judge/dead/unparseable"] for m in metrics] == [0.0, 0.0]
    assert "judge 'dead' at http://127.0.0.1" in caplog.text and "refused" in caplog.text
    slow = Judge(endpoint.base_url, "judge", timeout_s=1.0, retries=0, name="slow")
    start = time.monotonic()
    values, metrics = slow.scored(["SLOW"], ["a GOOD one"])
    assert values == [None] and metrics[0]["judge/slow/errors"] == 1.0 and time.monotonic() - start < 2.9
    with OpenAIEndpoint(ScriptedEngine(TOK, judge_script), model="judge", api_key="k") as locked:
        assert Judge(locked.base_url, "judge", api_key="k")(["q"], ["GOOD"]) == [pytest.approx(0.8)]
        values, metrics = Judge(locked.base_url, "judge", api_key="nope", retries=0).scored(["q"], ["GOOD"])
        assert values == [None] and metrics[0]["judge/judge/errors"] == 1.0


def test_bad_judges_fail_at_construction():
    with pytest.raises(ValueError, match=r"http\(s\) URL"):
        Judge("127.0.0.1:8000", "m")
    with pytest.raises(ValueError, match=r"neither \{prompt\} nor \{completion\}"):
        Judge("http://h/v1", "m", template="Rate it.")
    with pytest.raises(ValueError, match=r"literal braces"):
        Judge("http://h/v1", "m", template="{prompt} {")
    with pytest.raises(ValueError, match=r"parse"):
        Judge("http://h/v1", "m", parse="stars")
    with pytest.raises(ValueError, match=r"low < high"):
        Judge("http://h/v1", "m", scale=(5, 5))


ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def test_function_env_weighs_a_judge_beside_functions_and_counts_it(endpoint):
    judge = Judge(endpoint.base_url, "judge", name="rater",
                  template="{prompt} (reference {answer}) -> {completion}")
    env = FunctionEnv(ROWS, [exact, judge], reward_weights=[1.0, 0.5], heldout=10)
    task = next(iter(env.tasks("train")))
    answer = task.info["columns"]["answer"]
    rewards = env.rewards(task, [answer, "a GOOD try", "WEIRD"])
    assert [r for r, _ in rewards] == [pytest.approx(0.5 * 0.2 + 1.0), pytest.approx(0.5 * 0.8), 0.0]
    weird = rewards[2][1]
    assert "reward/rater" not in weird and weird["reward/exact"] == 0.0  # the judge's value is None: not counted
    assert weird["judge/rater/unparseable"] == 1.0 and weird["judge/rater/errors"] == 0.0
    assert env.reward_names == ["exact", "rater"]
