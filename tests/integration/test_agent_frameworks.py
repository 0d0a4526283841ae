"""Agents written with agent frameworks, unchanged, through `AgentEnv` (`astratk.envs.price_lookup_agents`): the OpenAI
Agents SDK and LangGraph over `langchain-openai` (streaming). First an episode each against a scripted model (every
token known): the tool loop runs, the reward is right, the trajectory is the engine's tokens, and the framework's
re-serialised tool-call turn is reused as sampled. Then each trains a few steps of a real run on the tiny model,
warm-started on the price-lookup demonstrations. Skipped where a framework is not installed (the `agent` extra)."""

from __future__ import annotations

import importlib.util
import math

import pytest

from astratk.engines.scripted import ScriptedEngine
from astratk.envs import price_lookup, price_lookup_agents
from astratk.envs.agent import AgentEnv
from astratk.runtime.run import Run
from astratk.spec import EvalSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TinyModelSpec, TrainerSpec
from tests.integration.test_agent_env import ROWS, TOK, lookup_script, rollout

pytestmark = pytest.mark.integration

FRAMEWORKS = {"openai_agents": "agents", "langgraph": "langgraph"}


def _agent(name: str):
    module = FRAMEWORKS[name]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install -e '.[agent]'")
    return getattr(price_lookup_agents, name)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_a_framework_agent_runs_its_tool_loop_on_the_endpoint_token_for_token(name):
    env = AgentEnv(ROWS, _agent(name), price_lookup.reward, heldout=2)
    engine = ScriptedEngine(TOK, lookup_script(), logprob=math.log(0.5), version=3)
    task, [traj] = rollout(env, {"policy": engine})
    m = traj.metrics
    assert env.score(task, [traj]) == [1.0], (m, [TOK.decode(list(r.prompt_ids)) for r in engine.requests])
    assert (m["calls"], m["tool_calls"], m["agent_error"]) == (2, 1, 0)
    # the second prompt reused the first call's sampled tokens, whatever the framework re-serialised
    assert m["reused_turns"] == 1 and m["segments_dropped"] == 0
    first, second = engine.requests
    c1, c2 = (lookup_script()(r.prompt_ids, r.params) for r in (first, second))
    assert second.prompt_ids[:len(first.prompt_ids) + len(c1)] == first.prompt_ids + tuple(c1)
    assert traj.tokens == second.prompt_ids + tuple(c2) and traj.n_prompt == len(first.prompt_ids)
    completion = traj.tokens[traj.n_prompt:]
    assert [t for t, keep in zip(completion, traj.loss_mask) if keep] == list(c1) + list(c2)  # trained: as sampled
    assert all(lp == pytest.approx(math.log(0.5)) for lp, keep in zip(traj.behavior_logprobs, traj.loss_mask) if keep)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_a_framework_agent_trains_a_few_steps(name, tmp_path):
    env = AgentEnv(price_lookup.rows(400, seed=0), _agent(name), price_lookup.reward, heldout=8,
                   demonstrations=price_lookup.demonstrations)
    spec = RunSpec(name=f"agent-{name}", output_dir=str(tmp_path / "runs"), env=env, policies=[PolicySpec(
        model=ModelSpec(tiny=TinyModelSpec(warm_start_steps=30, warm_start_batch=32, warm_start_target=None)),
        trainer=TrainerSpec(max_steps=2, groups_per_step=2, lr=1e-4, checkpoint_every=None))],
        rollout=RolloutSpec(group_size=4, max_new_tokens=48, tasks_per_chunk=2),
        dataflow={"filter_zero_variance": False}, eval=EvalSpec(interval_s=600, max_tasks=8), progress=False)
    lines: list[str] = []
    result = Run(spec, printer=lines.append).start()
    assert result.summary["steps"] == 2, lines[-20:]
    ds = result.metrics()
    calls = float(ds["data_traj_policy_calls_mean"].sel(policy="main").max())
    assert calls >= 1.0, lines[-20:]  # the framework's episodes reached the endpoint
    assert float(ds["data_traj_policy_agent_error_mean"].sel(policy="main").max()) < 1.0, lines[-20:]
