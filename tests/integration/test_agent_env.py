"""`AgentEnv` with agents written against the real `openai` client: episodes captured token for token (a scripted
engine decides what the model says, so every token and log-prob is known), earlier turns reused exactly as sampled
even when the template would render them differently, history rewrites counted, several roles, and agents or
rewards that raise or hang ending their episode with a counted reason."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import time

import pytest

from astratk.contracts import SamplingParams
from astratk.engines.scripted import ScriptedEngine
from astratk.envs import price_lookup
from astratk.envs.agent import AgentEnv
from astratk.models.chat import stop_token_ids
from astratk.models.tokenizer import build_char_tokenizer
from astratk.rollout.bounded import run_episodes

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration

TOK = build_char_tokenizer()
END = stop_token_ids(TOK)[0]
ROWS = price_lookup.rows(12, seed=1)


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def lookup_script(call_json=None):
    """The model of a perfect episode: a lookup call for the item in the question, then the price from the tool."""
    def script(prompt, params):
        text = TOK.decode(list(prompt))
        question = text.split("price of ", 1)[1].split("?", 1)[0]
        if "<|im_start|>tool" in text:
            return ids(text.rsplit(": ", 1)[1].split("<|im_end|>")[0]) + [END]
        body = call_json or json.dumps({"name": "lookup", "arguments": {"item": question}})
        return ids(f"<tool_call>{body}</tool_call>") + [END]
    return script


def rollout(env, engines, *, seed=11, temperature=1.0, task=None):
    task = task or next(iter(env.tasks("train")))
    sampling = SamplingParams(temperature=temperature, max_tokens=96, seed=seed)
    routes = {role: f"p-{role}" for role in env.roles}
    return task, run_episodes(env.rollout(task, engines, sampling, policy_ids=routes, group_id="L1/0"))


def test_an_episode_is_the_engines_tokens_and_log_probs_exactly():
    env = AgentEnv(ROWS, price_lookup.agent, price_lookup.reward, heldout=2)
    engine = ScriptedEngine(TOK, lookup_script(), logprob=math.log(0.25), version=4)
    task, [traj] = rollout(env, {"policy": engine})
    first, second = engine.requests[0], engine.requests[1]
    c1, c2 = lookup_script()(first.prompt_ids, first.params), lookup_script()(second.prompt_ids, second.params)
    # the second prompt is the first prompt + the sampled call + the tool's message, token for token
    assert second.prompt_ids[:len(first.prompt_ids) + len(c1)] == first.prompt_ids + tuple(c1)
    assert traj.tokens == second.prompt_ids + tuple(c2)
    assert traj.n_prompt == len(first.prompt_ids)
    mask = [0] * (len(second.prompt_ids) - len(first.prompt_ids) - len(c1))
    assert list(traj.loss_mask) == [1] * len(c1) + mask + [1] * len(c2)
    assert all(lp == pytest.approx(math.log(0.25)) for lp, m in zip(traj.behavior_logprobs, traj.loss_mask) if m)
    assert {v for v, m in zip(traj.behavior_versions, traj.loss_mask) if m} == {4}
    # the run's sampling reached the engine: its temperature, and a seed per call
    assert first.params.temperature == 1.0 and first.params.seed == 11 and second.params.seed == 11 + 7919
    # the template renders the same conversation to the same tokens (here the model wrote the canonical call)
    row = env.row(task)
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "lookup", "arguments": {"item": row["item"]}}}]}
    rendered = TOK.apply_chat_template([{"role": "user", "content": row["prompt"]}, call,
                                        {"role": "tool", "content": price_lookup.lookup(row["prices"], row["item"])}],
                                       tools=price_lookup.TOOLS, add_generation_prompt=True, tokenize=False)
    assert second.prompt_ids == tuple(ids(rendered))
    m = traj.metrics
    assert (m["calls"], m["tool_calls"], m["reused_turns"], m["segments_dropped"]) == (2, 1, 1, 0)
    assert m["agent_reward"] == 1.0 and env.score(task, [traj]) == [1.0]
    assert m["agent_error"] == m["agent_timeout"] == m["reward_error"] == 0
    assert m["policy_tokens"] == len(c1) + len(c2) and m["env_tokens"] == len(mask)


def test_a_call_the_template_would_render_differently_is_kept_as_sampled():
    """No re-tokenisation drift: the model's compact JSON stays as sampled in the next prompt, though the template
    would render the agent's re-serialised message with spaces."""
    env = AgentEnv(ROWS, price_lookup.agent, price_lookup.reward, heldout=2)
    task = next(iter(env.tasks("train")))
    compact = json.dumps({"name": "lookup", "arguments": {"item": env.row(task)["item"]}}, separators=(",", ":"))
    engine = ScriptedEngine(TOK, lookup_script(compact))
    _, [traj] = rollout(env, {"policy": engine}, task=task)
    first, second = engine.requests[:2]
    sampled = ids(f"<tool_call>{compact}</tool_call>") + [END]
    assert second.prompt_ids[len(first.prompt_ids):len(first.prompt_ids) + len(sampled)] == tuple(sampled)
    assert traj.metrics["reused_turns"] == 1 and traj.metrics["agent_reward"] == 1.0


def test_history_rewrites_start_a_new_segment_and_the_dropped_one_is_counted():
    def forgetful(task, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["prompt"]}],
                                               tools=price_lookup.TOOLS)
        item = json.loads(first.choices[0].message.tool_calls[0].function.arguments)["item"]
        # a new conversation instead of the history: the model sees a prompt it did not continue
        fresh = [{"role": "user", "content": f"{task['prompt']} lookup says {price_lookup.lookup(task['prices'], item)}"}]
        return client.chat.completions.create(model=model, messages=fresh).choices[0].message.content

    call = ids('<tool_call>{"name": "lookup", "arguments": {"item": "A1"}}</tool_call>') + [END]
    engine = ScriptedEngine(TOK, [call, ids("42") + [END]])
    env = AgentEnv(ROWS, forgetful, lambda output: 0.5, heldout=2)
    _, [traj] = rollout(env, {"policy": engine})
    m = traj.metrics
    assert (m["calls"], m["segments_dropped"], m["reused_turns"]) == (2, 1, 0)
    assert m["tokens_dropped"] == len(call)
    assert traj.tokens == engine.requests[1].prompt_ids + tuple(ids("42") + [END])
    assert m["agent_reward"] == 0.5


def test_several_roles_each_get_their_own_url_and_engine():
    async def duo(task, base_urls, api_key, models):
        async with openai.AsyncOpenAI(base_url=base_urls["solver"], api_key=api_key, max_retries=0) as s, \
                openai.AsyncOpenAI(base_url=base_urls["critic"], api_key=api_key, max_retries=0) as c:
            answer = (await s.chat.completions.create(model=models["solver"], messages=[
                {"role": "user", "content": task["prompt"]}])).choices[0].message.content
            verdict = (await c.chat.completions.create(model=models["critic"], messages=[
                {"role": "user", "content": f"{task['prompt']} {answer} ok?"}])).choices[0].message.content
            return answer, verdict

    def score(task, output):
        return {"solver": float(output[0] == "7"), "critic": float(output[1] == "no")}

    env = AgentEnv(ROWS, duo, score, roles=("solver", "critic"), heldout=2)
    solver, critic = ScriptedEngine(TOK, [ids("7") + [END]], version=1), ScriptedEngine(TOK, [ids("no") + [END]],
                                                                                         version=2)
    _, trajs = rollout(env, {"solver": solver, "critic": critic})
    by_role = {t.role: t for t in trajs}
    assert set(by_role) == {"solver", "critic"} and by_role["critic"].policy_id == "p-critic"
    assert {v for v in by_role["solver"].behavior_versions if v >= 0} == {1}
    assert {v for v in by_role["critic"].behavior_versions if v >= 0} == {2}
    assert by_role["solver"].metrics["agent_reward"] == 1.0 and by_role["critic"].metrics["agent_reward"] == 1.0
    assert len(solver.requests) == len(critic.requests) == 1


def test_agents_and_rewards_that_fail_end_their_episode_counted():
    engine = ScriptedEngine(TOK, [ids("1") + [END]])

    def raises(task, base_url, api_key, model):
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}])
        raise RuntimeError("agent bug")

    def hangs(task, base_url, api_key):
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}])
        time.sleep(30)

    async def hangs_async(task, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        await asyncio.sleep(30)

    async def blocks_async(task, base_url, api_key):  # the sync client and a blocking sleep inside async code
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}])
        time.sleep(30)  # noqa: ASYNC251 - the bug under test

    def exits(task, base_url, api_key, model):
        raises_after_a_call = raises  # the same call, then sys.exit
        try:
            raises_after_a_call(task, base_url, api_key, model)
        except RuntimeError:
            raise SystemExit(3) from None

    def own_timeout(task, base_url, api_key, model):
        try:
            raises(task, base_url, api_key, model)
        except RuntimeError:
            raise TimeoutError("the agent's own tool timed out") from None

    cases = [(AgentEnv(ROWS, raises, price_lookup.reward, heldout=2), "agent_error", 0.0),
             (AgentEnv(ROWS, raises, price_lookup.reward, heldout=2, error_reward=None), "agent_error", None),
             (AgentEnv(ROWS, hangs, price_lookup.reward, heldout=2, agent_timeout_s=0.5), "agent_timeout", 0.0),
             (AgentEnv(ROWS, hangs_async, price_lookup.reward, heldout=2, agent_timeout_s=0.5), "agent_timeout", 0.0),
             (AgentEnv(ROWS, blocks_async, price_lookup.reward, heldout=2, agent_timeout_s=0.5), "agent_timeout", 0.0),
             (AgentEnv(ROWS, exits, price_lookup.reward, heldout=2), "agent_error", 0.0),
             (AgentEnv(ROWS, own_timeout, price_lookup.reward, heldout=2, agent_timeout_s=5), "agent_error", 0.0),
             (AgentEnv(ROWS, price_lookup.agent, lambda output: 1 / 0, heldout=2), "reward_error", None),
             (AgentEnv(ROWS, price_lookup.agent, lambda output: "yes", heldout=2), "reward_error", None),
             (AgentEnv(ROWS, price_lookup.agent, lambda output: time.sleep(30), heldout=2, reward_timeout_s=0.5),
              "reward_timeout", None)]
    for env, reason, reward in cases:
        t0 = time.perf_counter()
        task, [traj] = rollout(env, {"policy": engine})
        assert time.perf_counter() - t0 < 10, reason  # a hung agent or reward is abandoned at its bound
        assert traj.metrics[reason] == 1.0, (reason, traj.metrics)
        other = {"agent_error": "agent_timeout", "agent_timeout": "agent_error"}.get(reason)
        assert other is None or traj.metrics[other] == 0.0, (reason, traj.metrics)  # told apart
        assert env.score(task, [traj]) == [reward], reason
    # an agent that never called the model: the opening prompt, nothing to train, no reward (the data layer counts it)
    env = AgentEnv(ROWS, lambda task: "42", price_lookup.reward, heldout=2)
    task, [traj] = rollout(env, {"policy": engine})
    assert traj.metrics["no_calls"] == 1.0 and not traj.loss_mask and env.score(task, [traj]) == [None]


def test_the_run_temperature_wins_and_is_counted():
    def warm(task, base_url, api_key, model):
        c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "q"}],
                                         temperature=0.3).choices[0].message.content

    engine = ScriptedEngine(TOK, [ids("1") + [END]])
    _, [traj] = rollout(AgentEnv(ROWS, warm, price_lookup.reward, heldout=2), {"policy": engine}, temperature=0.9)
    assert engine.requests[0].params.temperature == 0.9 and traj.metrics["temperature_overridden"] == 1.0


def test_bad_arguments_fail_at_construction_and_the_env_pickles_without_its_server():
    with pytest.raises(TypeError, match="agent needs"):
        AgentEnv(ROWS, lambda task, endpoint: None, price_lookup.reward)
    with pytest.raises(TypeError, match="reward needs"):
        AgentEnv(ROWS, price_lookup.agent, lambda answer: 1.0)
    with pytest.raises(ValueError, match="roles"):
        AgentEnv(ROWS, price_lookup.agent, price_lookup.reward, roles=("a", "a"))
    with pytest.raises(ValueError, match="agent_timeout_s"):
        AgentEnv(ROWS, price_lookup.agent, price_lookup.reward, agent_timeout_s=0)
    env = AgentEnv(ROWS, "astratk.envs.price_lookup.agent", "astratk.envs.price_lookup:reward", heldout=2)
    endpoint = env.endpoint()
    copy = pickle.loads(pickle.dumps(env))
    assert copy._endpoint is None and copy.agent == "astratk.envs.price_lookup.agent"
    assert env.endpoint() is endpoint and endpoint.running
    # closed sessions refuse late requests (an abandoned agent's next call ends it)
    url = endpoint.open_session("late", ScriptedEngine(TOK, [[END]]))
    endpoint.close_session("late")
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=url, api_key=endpoint.api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}])


def test_the_readme_agent_example_runs_an_episode():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL) if "AgentEnv(" in b]
    scope = {"rows": ROWS}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the repository's own README
    env = scope["env"]
    task = next(iter(env.tasks("train")))
    engine = ScriptedEngine(TOK, [ids(env.row(task)["answer"]) + [END]])
    _, [traj] = rollout(env, {"policy": engine}, task=task)
    assert traj.metrics["calls"] == 1 and env.score(task, [traj]) == [1.0]


def test_with_several_choices_the_one_the_agent_went_on_with_is_kept():
    from astratk.contracts import Completion
    from astratk.envs.agent import trajectory_from_calls
    from astratk.records import Task
    from astratk.rollout.openai_sessions import CapturedCall

    def done(tokens, v):
        return Completion(tuple(tokens), tuple([-0.5] * len(tokens)), tuple([v] * len(tokens)), "stop")

    first = CapturedCall("s", "c1", [], None, (1, 2), (done([10, 11], 3), done([20, 21], 3)), 0.0, 0.01)
    second = CapturedCall("s", "c2", [], None, (1, 2, 20, 21, 7, 7), (done([30], 4),), 1.0, 0.02, "c1", 1)
    traj = trajectory_from_calls([first, second], TOK, task=Task("t", "agent", "q"), group_id="g", policy_id="p",
                                 role="policy")
    assert traj.tokens == (1, 2, 20, 21, 7, 7, 30) and traj.loss_mask == (1, 1, 0, 0, 1)
    assert traj.behavior_versions == (3, 3, -1, -1, 4) and traj.metrics["segments_dropped"] == 0
    assert traj.metrics["endpoint_latency_s"] == pytest.approx(0.015)
    with pytest.raises(ValueError, match="no captured calls"):
        trajectory_from_calls([], TOK, task=Task("t", "agent", "q"), group_id="g", policy_id="p", role="policy")
    # calls that recorded different top-k widths: the trajectory keeps the width every generated token has
    wide = Completion((10, 11), (-0.5, -0.5), (3, 3), "stop", ((1, 2, 3), (1, 2, 3)), ((-1.0,) * 3, (-1.0,) * 3))
    narrow = Completion((30,), (-0.5,), (4,), "stop", ((5, 6),), ((-1.0, -2.0),))
    first = CapturedCall("s", "c1", [], None, (1, 2), (wide,), 0.0, 0.01)
    second = CapturedCall("s", "c2", [], None, (1, 2, 10, 11, 7), (narrow,), 1.0, 0.02, "c1", 0)
    traj = trajectory_from_calls([first, second], TOK, task=Task("t", "agent", "q"), group_id="g", policy_id="p",
                                 role="policy")
    assert [len(row) for row in traj.behavior_topk_ids] == [2, 2, 0, 2]


def test_the_warm_start_checks_an_agent_turn_by_turn():
    """A held-out task counts only when greedy decoding reproduces every turn of its demonstrations."""
    import torch

    from astratk.models.warm_start import _examples, heldout_accuracy

    env = AgentEnv(ROWS, price_lookup.agent, price_lookup.reward, heldout=4, demonstrations=price_lookup.demonstrations)
    tasks = list(env.tasks("heldout"))
    answers = {tuple(p): c for t in tasks for p, c in _examples(TOK, env, t)}
    wrong_turn = {tuple(p) for p, _ in _examples(TOK, env, tasks[0])[1:]}  # task 0's second turn comes out wrong

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
            rows = []
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
                prompt = tuple(i for i, m in zip(ids, mask) if m)
                out = list(answers[prompt]) if prompt not in wrong_turn else ids[-1:] + [END]
                rows.append(ids + (out + [TOK.pad_token_id] * max_new_tokens)[:max_new_tokens])
            return torch.tensor(rows)

    accuracy, finished, n = heldout_accuracy(Model(), TOK, env)
    assert (accuracy, finished, n) == (3 / 4, 1.0, 4)
