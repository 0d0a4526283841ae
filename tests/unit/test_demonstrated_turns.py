"""A warm-start demonstration may be an assistant message (content, tool_calls): the model's chat template writes its
text (`astratk.models.warm_start.rendered_turn`), for the tiny model's ChatML and for a Qwen-style template alike; a
template that writes no tool calls, or rewrites earlier turns, is refused in one line instead of training on a turn
without its call."""

from __future__ import annotations

import json

import pytest

from astratk.models.chat import encode_chat, parse_tool_calls
from astratk.models.tokenizer import build_char_tokenizer
from astratk.models.warm_start import rendered_turn

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"item": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "price of tea?"}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": {"item": "tea"}}}]}

# Qwen2.5's way of writing tools, calls and tool results (shortened system text), on the tiny tokenizer
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _completion(tok, message=CALL) -> str:
    prompt = encode_chat(tok, ASK, tools=TOOLS)
    return tok.decode(rendered_turn(tok, ASK, message, TOOLS, prompt))


def test_the_tiny_template_writes_the_call_as_the_parser_reads_it():
    tok = build_char_tokenizer()
    assert _completion(tok) == '<tool_call>{"name": "lookup", "arguments": {"item": "tea"}}</tool_call><|im_end|>'
    answer = {"role": "assistant", "content": "3 coins"}
    assert _completion(tok, answer) == "3 coins<|im_end|>"


def test_a_qwen_style_template_writes_its_own_call_format():
    tok = build_char_tokenizer()
    tok.chat_template = QWEN_STYLE
    text = _completion(tok)
    assert text.startswith("<tool_call>\n") and text.endswith("</tool_call><|im_end|>")
    body = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call><|im_end|>")])
    assert body == {"name": "lookup", "arguments": {"item": "tea"}}


@pytest.mark.parametrize(("template", "message"), [
    # drops tool calls (a chat model without tool support): the turn would train on an empty answer
    (("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"), "renders no tool call of"),
    # renders the earlier turns differently once an answer follows them (a 'thinking' template, say)
    (("{% for m in messages %}{{ '<|im_start|>' + m.role + (' last' if loop.last else '') + '\\n' + (m.content or '')"
     " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
     "as a continuation of its prompt"),
])
def test_a_template_that_cannot_render_the_turn_is_refused_in_one_line(template, message):
    tok = build_char_tokenizer()
    tok.chat_template = template
    with pytest.raises(ValueError, match=message):
        prompt = encode_chat(tok, ASK, tools=TOOLS, tool_format="template")
        rendered_turn(tok, ASK, CALL, TOOLS, prompt, tool_format="template")


def test_a_template_without_tool_support_gets_the_call_in_the_fallback_format():
    """The template that drops tools and calls (first case above): under tool_format auto the demonstration is
    written in the hermes fallback, which the endpoint's parser reads back, as the episodes are."""
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + "
                         "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                         "{% endif %}")
    text = _completion(tok)
    [call] = parse_tool_calls(text)
    assert not call.error and (call.name, call.arguments) == ("lookup", {"item": "tea"})
    assert "<tools>" in tok.decode(encode_chat(tok, ASK, tools=TOOLS))  # the prompt lists the tool
