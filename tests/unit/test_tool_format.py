"""Tools reach the model whatever its chat template (`astratk.models.tools`): a template that drops `tools` is
detected, the hermes fallback writes them into the system message, the endpoint parses the calls back, and
unparseable calls are counted."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import ClassVar

import pytest

from astratk.dataflow.learning_signal import AgentReading, SignalReading, agent_counts, describe
from astratk.engines import ScriptedEngine
from astratk.models import build_char_tokenizer
from astratk.models.chat import encode_chat, parse_tool_calls
from astratk.models.tools import (
    check_tool_format,
    convert_turns,
    prepare_messages,
    resolve_tool_format,
    template_renders_tools,
    tool_formats_asked,
)
from astratk.rollout.openai_api import OpenAIEndpoint

# Plain ChatML with a default system line and no tool section: SmolLM2-135M-Instruct's template has this shape
PLAIN = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def plain_tok():
    tok = copy.deepcopy(build_char_tokenizer())
    tok.chat_template = PLAIN
    return tok


def test_a_template_without_a_tool_section_is_detected(plain_tok):
    tok = build_char_tokenizer()
    assert template_renders_tools(tok) and resolve_tool_format(tok) == "template"
    with_tools = plain_tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert with_tools == plain_tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)  # dropped
    assert not template_renders_tools(plain_tok)
    assert resolve_tool_format(plain_tok) == "hermes" and resolve_tool_format(plain_tok, "template") == "template"
    with pytest.raises(ValueError, match="choose one of"):
        check_tool_format("json")


def test_the_fallback_puts_the_tools_in_the_system_message_and_the_prompt(plain_tok):
    ids = encode_chat(plain_tok, ASK, tools=[WEATHER])
    text = plain_tok.decode(ids)
    assert '"name": "weather"' in text and "<tool_call>" in text and text.startswith("<|im_start|>system\nYou can call")
    # forcing the template shows the model nothing: the same prompt as without tools
    assert encode_chat(plain_tok, ASK, tools=[WEATHER], tool_format="template") == encode_chat(plain_tok, ASK)
    # a system message of the user's keeps its text, the tools after it
    msgs, tools = prepare_messages([{"role": "system", "content": "Be brief."}, *ASK], [WEATHER], "hermes")
    assert tools is None and msgs[0]["content"].startswith("Be brief.\n\nYou can call") and msgs[1] == ASK[0]


def test_calls_and_results_are_written_back_as_text():
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"}]
    out = convert_turns(history)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]  # the two results in one user message
    calls = parse_tool_calls(out[1]["content"])
    assert [(c.name, c.arguments) for c in calls] == [("weather", {"city": "Oslo"}), ("weather", {"city": "Bergen"})]
    assert out[2]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)


@pytest.mark.parametrize("fmt", ["auto", "template"])
def test_an_episodes_tool_results_are_the_tokens_the_warm_start_trains_on(plain_tok, fmt):
    """A multi-turn env appends tool results turn by turn (`ChatTurns`) while the warm start renders whole
    conversations (`encode_chat`); both write them the same way: as a hermes user message of `<tool_response>`
    blocks on a template without a tool section, as the template's own role when forced."""
    from astratk.models.chat import ChatTurns

    turns = ChatTurns(plain_tok, tool_format=fmt)
    head = [*ASK, {"role": "assistant", "content": '<tool_call>{"name": "weather"}</tool_call>'}]
    before = plain_tok.apply_chat_template(head, tokenize=False)
    before = before[:len(before) - len(turns.close)]  # up to the end of the assistant's content
    for results in ([{"role": "tool", "content": "rain"}],
                    [{"role": "tool", "content": "rain"}, {"role": "tool", "content": "sun"}]):
        whole = plain_tok.decode(encode_chat(plain_tok, head + results, tool_format=fmt))
        stepped = before + (turns.continuation("tool", "rain", "") if len(results) == 1
                            else turns.continuation_of(results, ""))
        assert stepped == whole
        assert ("<tool_response>\nrain\n</tool_response>" in stepped) == (fmt == "auto")
        assert ("<|im_start|>tool" in stepped) == (fmt == "template")


def test_unparseable_calls_are_errors_not_text():
    good, bad, unclosed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call> '
                                           '<tool_call>{"name": </tool_call> <tool_call>{"name": "b", "argu')
    assert not good.error and good.name == "a"
    assert bad.error.startswith("invalid JSON")
    assert "never closed" in unclosed.error and unclosed.raw.startswith('{"name": "b"')
    assert parse_tool_calls("plain text, no calls") == []


def _endpoint_round_trip(tok, tool_format):
    """One agent turn through the endpoint: the model (scripted) answers with a hermes call; returns the prompt the
    engine saw and the OpenAI message."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    seen = []

    def script(prompt, params):
        seen.append(tok.decode(list(prompt)))
        return tok(reply, add_special_tokens=False)["input_ids"] + [end]

    engine = ScriptedEngine(tok, script)

    async def call(ep):
        body = {"model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 200}
        return await ep._complete(__import__("astratk.rollout.openai_format", fromlist=["x"]).parse_request(body, 64),
                                  "s", ep._session("s"))

    with OpenAIEndpoint(engine, model="m", tool_format=tool_format) as ep:
        answer, _ = asyncio.run(call(ep))
    return seen[0], answer["choices"][0]["message"]


def test_the_endpoint_shows_tools_to_a_model_whose_template_drops_them(plain_tok):
    prompt, message = _endpoint_round_trip(plain_tok, "auto")
    assert '"name": "weather"' in prompt  # the model saw the tool
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    prompt, _ = _endpoint_round_trip(plain_tok, "template")
    assert "weather" not in prompt  # forced: the template's rendering, which drops them


def test_agent_readings_say_what_to_change():
    episodes = [agent_counts({"calls": 1.0, "tool_calls": 0.0, "tool_call_errors": 0.0}) for _ in range(256)]
    reading = AgentReading.of(episodes, tools_shown=True, tool_format="hermes")
    assert reading.line().startswith("agent: 256 episodes, 0.00 tool calls")
    [advice] = reading.advice(64)
    assert "no tool call in 256 episodes" in advice
    hidden = AgentReading.of(episodes, tools_shown=False, tool_format="template")
    assert "never saw its tools" in hidden.advice(64)[0]
    # a multi-turn env's own protocol: invalid actions count as unparseable, turn limits as endings
    search = [agent_counts({"turns": 4.0, "tool_calls": 1.0, "invalid_actions": 3.0, "turn_limit": 1.0})] * 10
    r = AgentReading.of(search)
    assert r.per_episode("unparsed_calls") == 3.0 and r.per_episode("turns") == 4.0
    text = " ".join(r.advice(32))
    assert "3 of 4" not in text and "30 of 40 tool calls could not be parsed" in text and "ran out of turns" in text
    assert agent_counts({"reward": 1.0}) is None  # a single-turn episode is no agent's
    line = describe(SignalReading(groups=32, admitted=0, dropped={"zero_variance": 32}, samples=256,
                                  reward_mean=0.0, agent=reading), group_size=8, temperature=1.0, max_new_tokens=64)
    assert "agent: 256 episodes" in line and "no tool call in 256 episodes" in line


def test_a_multi_turn_env_without_tools_is_not_told_to_call_them():
    """A solver + verifier conversation counts turns (and a `tool_calls` of 0, as every multi-turn conversation does)
    but reads no tool calls or actions: its reading says so, and no advice asks it for tool calls."""
    episodes = [agent_counts({"turns": 2.0, "tool_calls": 0.0, "truncated_turns": 0.0})] * 64
    r = AgentReading.of(episodes)
    assert not r.has_tools and r.tool_episodes == 0
    assert r.line().startswith("agent: 64 episodes, no tools, 2.0 turns per episode")
    assert not any("tool" in a for a in r.advice(32))
    # one episode that reads actions is enough to make it a tool env
    assert AgentReading.of(episodes + [agent_counts({"turns": 1.0, "format_errors": 0.0})]).has_tools


def test_envs_that_serve_tools_are_found():
    class Tools:
        tool_format = "auto"

    class Mixture:
        envs: ClassVar[dict] = {"a": Tools(), "b": object()}

    assert tool_formats_asked(Tools()) == ["auto"] and tool_formats_asked(Mixture()) == ["auto"]
    assert tool_formats_asked(object()) == []
