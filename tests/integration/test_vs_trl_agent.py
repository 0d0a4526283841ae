"""`bench/vs_trl.py --task tool-agent`: what keeps the two sides' agent runs the same, on SmolLM2's own tokenizer.

TRL sees exactly the tokens astratk's fallback renders (prompts and whole episodes with calls and results), its own
parser reads the model's calls back as astratk's endpoint does, its tools answer as the env's, its reward is the
env's, and its step holds the same episodes as astratk's. A whole quick run costs minutes (the warm start is built
once, ~5 minutes here); this part costs seconds. Needs the `bench` extra (trl)."""

from __future__ import annotations

import json

import pytest

from astratk.envs import price_total
from astratk.models.chat import encode_chat
from astratk.rollout.openai_format import _tool_calls
from tests._bench import bench_module

pytestmark = [pytest.mark.integration, pytest.mark.realmodel]

@pytest.fixture(scope="module")
def agent_bench():
    return bench_module("_vs_trl_agent")


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir, agent_bench):
    """TRL's tokenizer as the TRL process sets it up, and the one astratk loads."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    from astratk.models.loading import load_tokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2_dir)
    theirs.chat_template = agent_bench.trl_template(theirs.chat_template)
    theirs.response_template = qwen3_template
    return theirs, load_tokenizer(smollm2_dir), smollm2_dir


def test_trl_renders_astratks_tokens_and_accepts_the_template(agent_bench, tokenizers):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    theirs, ours, model_dir = tokenizers
    env = agent_bench.PriceTools()
    rows = price_total.rows(12, seed=3)
    check = agent_bench.check_renders(theirs, ours, rows, [env.lookup, env.add])
    assert check["prompt_ids_equal"] and check["episode_ids_equal"], check["example_episode"]
    assert "<tools>" in check["example_episode"] and "<tool_response>" in check["example_episode"]
    # what GRPOTrainer asks of a template before it runs tools
    assert supports_tool_calling(theirs)
    assert is_chat_template_prefix_preserving(theirs)
    # without tools the template is SmolLM2's own
    plain = [{"role": "user", "content": "hi"}]
    smol = type(theirs).from_pretrained(model_dir)
    assert theirs.apply_chat_template(plain, tokenize=False) == smol.apply_chat_template(plain, tokenize=False)


def test_trl_parses_the_models_calls_as_astratks_endpoint_does(agent_bench, tokenizers):
    from trl.chat_template_utils import parse_response

    theirs, ours, _ = tokenizers
    env = agent_bench.PriceTools()
    for row in price_total.rows(6, seed=5):
        for history, reply, _ in price_total.demonstrations(row):
            prompt = encode_chat(ours, history, price_total.TOOLS, "hermes")
            whole = encode_chat(ours, [*history, reply if isinstance(reply, dict) else
                                       {"role": "assistant", "content": reply}], price_total.TOOLS, "hermes")
            # the reply's tokens as the model would write them: up to and with the end of its turn
            reply_ids = whole[len(prompt):]
            end = ours.convert_tokens_to_ids("<|im_end|>")
            reply_ids = reply_ids[:reply_ids.index(end) + 1]
            parsed = parse_response(theirs, reply_ids, prefix=prompt, tools=[env.lookup, env.add])
            content, calls = _tool_calls(ours.decode(reply_ids[:-1], skip_special_tokens=True))
            theirs_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.get("tool_calls") or []]
            ours_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
            assert theirs_calls == ours_calls, (parsed, calls)
            if not calls:
                assert parsed["content"].strip() == content.strip() == row["answer"]


def test_trl_tools_and_reward_are_the_envs(agent_bench):
    rows = price_total.rows(4, seed=1)
    agent_bench.PriceTools.rows = rows
    try:
        for i, row in enumerate(rows):
            env = agent_bench.PriceTools()
            env.reset(task_index=i, prompt="ignored")
            a, b = row["items"]
            assert env.lookup(a) == price_total.run_tool(row, "lookup", {"item": a}) == str(row["prices"][a])
            assert env.lookup("no such item") == price_total.run_tool(row, "lookup", {"item": "no such item"})
            assert env.add(row["prices"][a], row["prices"][b]) == row["answer"]
    finally:
        agent_bench.PriceTools.rows = []
    reward = agent_bench.trl_reward(rows)
    answer = rows[0]["answer"]
    final = [{"role": "assistant", "content": f"The total is {answer}"}]
    on_a_call = [{"role": "assistant", "content": answer, "tool_calls": [{"function": {"name": "add"}}]}]
    wrong = [{"role": "assistant", "content": "The total is 1.5"}]
    ended_on_a_tool = [{"role": "tool", "content": answer}]
    assert reward([None] * 4, [final, on_a_call, wrong, ended_on_a_tool], [0, 0, 0, 0]) == [1.0, 0.0, 0.0, 0.0]


def test_trls_step_holds_astratks_episodes(agent_bench):
    spec = agent_bench.agent_spec({"name": "t", "output_dir": "unused", "seed": 0, "eval_interval_s": 60.0,
                                   "eval_max_tasks": 8})
    shape = agent_bench.trl_shape(spec)
    p, r = spec.policies[0], spec.rollout
    per_step = p.trainer.groups_per_step * r.group_size
    assert shape["per_device_train_batch_size"] * shape["gradient_accumulation_steps"] == per_step
    assert shape["num_generations"] == r.group_size and shape["temperature"] == r.temperature
    assert shape["generation_kwargs"] == {"max_new_tokens": r.max_new_tokens}
    # TRL counts tool-calling iterations after the first model turn; astratk's agent takes MAX_CALLS turns
    assert shape["max_tool_calling_iterations"] == price_total.MAX_CALLS - 1
    assert shape["max_completion_length"] >= price_total.MAX_CALLS * r.max_new_tokens
    assert p.model.lora is not None and (p.model.lora.r, p.model.lora.alpha) == (16, 32.0)
