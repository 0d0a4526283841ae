# %% [markdown]
# # 8. Train an agent written with the `openai` client, unchanged
#
# Most agents are already written against an OpenAI-style chat API. `AgentEnv` trains such an agent as it is: for every
# sample of a group it calls your agent function with a `base_url` and an `api_key` of an OpenAI-compatible endpoint
# that the rollout worker serves with the policy being trained. Every call the agent makes is recorded in token
# space (the prompt and completion tokens the engine used, their log-probs and weight versions), so the trajectory
# the trainer sees is exactly what was sampled: tool results and everything else the agent sends become context
# tokens (not trained on), the model's replies are the trained tokens.
#
# The task: each question asks for the price of an item, and only a `lookup` tool knows the prices (every question has
# its own random price list). A good episode is two calls: the model calls `lookup(item)`, the agent runs it and sends
# the result back, the model answers with the number. The test suite runs this with `ASTRATK_TUTORIAL_SHORT=1` (a
# smoke budget); the full version trains for 5 minutes.

# %%
import json

from openai import OpenAI

import astratk
import astratk.viz  # registers the .astra dashboards on metrics datasets
from astratk.envs import price_lookup
from astratk.envs.agent import AgentEnv
from astratk.losses.drpo import DRPO
from astratk.quick import short_mode, smoke
from astratk.spec import EvalSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TinyModelSpec, TrainerSpec

# %% [markdown]
# The agent: plain `openai` client code, nothing from astratk. It offers one function, runs the tool calls the model
# makes and sends the results back until the model answers.

# %%
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The price of an item.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]


def agent(task, base_url, api_key, model):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(3):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            try:
                item = json.loads(call.function.arguments).get("item")
            except (json.JSONDecodeError, AttributeError):
                item = None
            prices = task["prices"]
            result = f"{item}: {prices[item]}" if item in prices else f"no item {item}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def reward(task, output):
    return 1.0 if isinstance(output, str) and output.strip() == task["answer"] else 0.0


# %% [markdown]
# The dataset is a list of rows (a `datasets.Dataset` or a file works too); the agent gets the whole row as `task`.
# `demonstrations` (a good episode, turn by turn, with the tools) lets astratk warm-start a tiny model that knows the
# tool-call format but is still often wrong (it trains until greedy decoding reproduces 85% of the demonstrated turns:
# about 10 minutes on two laptop cores, once; the model is cached); with your own model, give `model.path` instead.
# Warm-start far enough: RL learns only from groups whose samples differ in reward, and a model that almost never
# answers right gives groups of zeros (the benchmark saw a 3% start learn nothing; a 65% start gained 10 points in
# 5 minutes).

# %%
rows = price_lookup.rows(4000, seed=0)
print(rows[0])
env = AgentEnv(rows, agent, reward, heldout=128, demonstrations=price_lookup.demonstrations)

spec = RunSpec(
    name="agent", output_dir="runs/tutorials", env=env,
    policies=[PolicySpec(
        model=ModelSpec(tiny=TinyModelSpec(warm_start_steps=2500, warm_start_target=0.85)),
        loss=DRPO(delta=0.2),
        trainer=TrainerSpec(max_time_s=300, groups_per_step=8, lr=1e-4))],
    rollout=RolloutSpec(group_size=8, max_new_tokens=80, tasks_per_chunk=8),
    eval=EvalSpec(interval_s=30, max_tasks=128))
run = astratk.Run(smoke(spec, steps=3) if short_mode() else spec)

# %%
result = run.start()
print(result)

# %% [markdown]
# Held-out accuracy is the agent's reward with greedy decoding, evaluated through the same agent code. The trajectory
# metrics say how the agent used the endpoint: calls and tool calls per episode, tokens per call, the endpoint's
# latency, how many prompts reused an earlier turn's tokens as sampled, and how many episodes ended in an agent error.

# %%
ds = result.metrics()
print("held-out accuracy:", ds["eval_accuracy"].sel(policy="main").values.round(3))
for name in ("calls", "tool_calls", "tokens_per_call", "endpoint_latency_s", "reused_turns", "agent_error"):
    key = f"data_traj_policy_{name}_mean"
    if key in ds:
        print(f"{name:>20}: {float(ds[key].sel(policy='main')):.3f}")
print("tutorial done")
