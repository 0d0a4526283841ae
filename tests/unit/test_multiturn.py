"""Multi-turn machinery: token-space conversations equal the chat template's rendering, env output is masked, budgets
bind and are counted, tool calls parse (and malformed ones are reported)."""

from __future__ import annotations

import asyncio

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.multiturn import Budget, ChatTurns, Conversation, parse_tags, parse_tool_calls
from astratk.models import build_char_tokenizer
from astratk.models.chat import encode_chat
from astratk.records import Task

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
TASK = Task("t/1", "test", "2+2?")


def said(text: str, end: bool = True) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + ([END] if end else [])


def run(coro):
    return asyncio.run(coro)


def test_chat_turns_follow_the_template():
    turns = ChatTurns(TOK)
    assert turns.close == "<|im_end|>\n"
    assert turns.continuation("tool", "X", "<|im_end|>") == "\n<|im_start|>tool\nX<|im_end|>\n<|im_start|>assistant\n"
    assert turns.continuation("user", "Y", "").startswith("<|im_end|>\n<|im_start|>user\nY")  # cut-off turn closed


def test_one_chat_turns_per_tokenizer_and_tool_format_is_shared_by_every_conversation():
    import gc

    from astratk.models.chat import _turns, chat_turns

    tok = build_char_tokenizer()  # a tokenizer of this test's own: its entry must go with it
    a = Conversation.start(tok, [{"role": "user", "content": "1?"}], Budget(max_turns=2))
    b = Conversation.start(tok, [{"role": "user", "content": "2?"}], Budget(max_turns=2))
    assert a.turns_api is b.turns_api is chat_turns(tok)  # derived once, its frames cached for every episode
    assert chat_turns(tok, "template") is not a.turns_api and chat_turns(tok, "template").tool_format == "template"
    assert chat_turns(TOK) is not chat_turns(tok)  # per tokenizer object, never by an id a new one could reuse
    n = len(_turns)
    del a, b, tok
    gc.collect()
    assert len(_turns) == n - 1


def test_conversation_equals_template_rendering_and_masks_env_tokens():
    engine = ScriptedEngine(TOK, [said("<search>x</search>"), said("4")])
    msgs = [{"role": "user", "content": "2+2?"}]
    conv = Conversation.start(TOK, msgs, Budget(max_turns=3))
    first = run(conv.assistant_turn(engine, SamplingParams(max_tokens=32)))
    assert parse_tags(first.text, ["search", "answer"]) == [("search", "x")]
    n_env = conv.add_message("tool", "x is 4", tool_call=True)
    second = run(conv.assistant_turn(engine, SamplingParams(max_tokens=32)))
    assert second.text == "4" and not second.truncated
    rendered = encode_chat(TOK, msgs + [{"role": "assistant", "content": "<search>x</search>"},
                                        {"role": "tool", "content": "x is 4"}])
    assert conv.tokens[:len(rendered)] == rendered  # nothing re-tokenised differently from the template
    traj = conv.trajectory(TASK, group_id="g", policy_id="p", role="solver")
    completion_mask = list(traj.loss_mask)
    n1, n2 = len(said("<search>x</search>")), len(said("4"))
    assert completion_mask == [1] * n1 + [0] * n_env + [1] * n2
    assert traj.behavior_versions == (0,) * n1 + (-1,) * n_env + (0,) * n2
    assert all(lp == 0.0 for lp, m in zip(traj.behavior_logprobs, completion_mask) if not m)
    assert traj.text == "4" and traj.finished
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 1 and traj.metrics["env_tokens"] == n_env


def test_budgets_bind_and_are_counted():
    engine = ScriptedEngine(TOK, [said("a" * 50, end=False)])
    conv = Conversation.start(TOK, [{"role": "user", "content": "q"}], Budget(max_turns=2, max_tokens_per_turn=10,
                                                                                max_env_tokens=5))
    t = run(conv.assistant_turn(engine, SamplingParams(max_tokens=99)))
    assert t.truncated and len(t.completion.token_ids) == 10
    conv.add_message("user", "z" * 40)
    text = TOK.decode(conv.tokens)
    assert conv.metrics["env_truncations"] == 1 and "z" * 5 + " ...[truncated]" in text and "z" * 6 not in text
    run(conv.assistant_turn(engine, SamplingParams(max_tokens=99)))
    assert not conv.can_continue and conv.metrics["truncated_turns"] == 2
    with pytest.raises(RuntimeError, match="no assistant turn left"):
        run(conv.assistant_turn(engine, SamplingParams()))
    assert not conv.trajectory(TASK, group_id="g", policy_id="p", role="r").finished

    small = Conversation.start(TOK, [{"role": "user", "content": "q"}], Budget(max_turns=9, max_context=40))
    run(small.assistant_turn(engine, SamplingParams(max_tokens=99)))
    assert len(small.tokens) == 40 and small.metrics["context_exhausted"] == 1 and not small.can_continue
    with pytest.raises(ValueError, match="max_context"):
        Conversation.start(TOK, [{"role": "user", "content": "q" * 50}], Budget(max_context=20))


def test_tool_call_parsing():
    text = ('<tool_call>{"name": "search", "arguments": {"q": "bm25"}}</tool_call> then '
            '<tool_call>{"name": oops}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    good, bad_json, no_name = parse_tool_calls(text)
    assert good.name == "search" and good.arguments == {"q": "bm25"} and not good.error
    assert bad_json.error.startswith("invalid JSON") and no_name.error.startswith("a tool call needs")
    assert parse_tool_calls("no calls") == []
    assert parse_tags("<answer> 42 </answer><search>unclosed", ["answer", "search"]) == [("answer", "42")]


# Qwen2.5's chat template, cut to what a text conversation uses: a default system turn, and tool results rendered as a
# user turn of <tool_response> blocks, consecutive tool messages merged into one turn.
QWEN25_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CALL = '<tool_call>{"name": "calc", "arguments": {"x": "2+2"}}</tool_call>'


def _qwen_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = QWEN25_TEMPLATE
    return tok


@pytest.mark.parametrize("results", [["4"], ["4", "four"]])
def test_qwen25_template_tool_turns_are_masked_and_equal_the_template(results):
    tok = _qwen_tokenizer()
    engine = ScriptedEngine(tok, [said(CALL), said("4")])
    msgs = [{"role": "user", "content": "2+2?"}]
    conv = Conversation.start(tok, msgs, Budget(max_turns=2))
    first = run(conv.assistant_turn(engine, SamplingParams(max_tokens=99)))
    [call] = parse_tool_calls(first.text)
    n_env = sum(conv.add_message("tool", r, tool_call=True) for r in results)  # one message per result
    run(conv.assistant_turn(engine, SamplingParams(max_tokens=99)))
    history = msgs + [{"role": "assistant", "content": CALL}] + [{"role": "tool", "content": r} for r in results]
    rendered = encode_chat(tok, history)
    assert conv.tokens == rendered + said("4")  # the whole conversation is the template's rendering
    traj = conv.trajectory(TASK, group_id="g", policy_id="p", role="solver")
    env_text = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    n1 = len(said(CALL))
    assert list(traj.loss_mask) == [1] * n1 + [0] * n_env + [1] * len(said("4"))
    assert tok.decode(conv.tokens[conv.n_prompt + n1:][:n_env]) == (
        f"\n<|im_start|>user{env_text}<|im_end|>\n<|im_start|>assistant\n")  # the model's <|im_end|> is its own
    assert traj.metrics["tool_calls"] == len(results) and traj.metrics["env_tokens"] == n_env
    assert call.name == "calc" and call.arguments == {"x": "2+2"}


# The last message gets an end-of-text mark, so an earlier turn renders differently once a message follows it.
CHAT_TEMPLATE_LAST_EOS = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{% if loop.last and not add_generation_prompt %}{{ '<|endoftext|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def after_one_turn(template: str):
    """(tokenizer with `template`, conversation after one assistant turn)."""
    tok = build_char_tokenizer()
    tok.chat_template = template
    conv = Conversation.start(tok, [{"role": "user", "content": "q"}], Budget(max_turns=2))
    run(conv.assistant_turn(ScriptedEngine(tok, [said("hi")]), SamplingParams(max_tokens=9)))
    return tok, conv


def test_template_without_fixed_separators_raises_a_clear_error():
    _, conv = after_one_turn(CHAT_TEMPLATE_LAST_EOS)
    with pytest.raises(ValueError, match="does not render a 'user' message after an assistant turn as a plain "
                                         "continuation.*fixed turn separators"):
        conv.add_message("user", "more")


# Mistral-style: roles must alternate user/assistant, or the template raises.
CHAT_TEMPLATE_ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_template_refusing_consecutive_messages_raises_a_clear_error():
    tok, conv = after_one_turn(CHAT_TEMPLATE_ALTERNATING)
    conv.add_message("user", "one")  # alone it alternates
    state = (list(conv.tokens), list(conv.loss_mask), dict(conv.metrics))
    with pytest.raises(ValueError, match=r"cannot render the messages \['user', 'user'\] in a row.*roles must "
                                         "alternate.*one message per turn"):
        conv.add_message("user", "two")
    assert (conv.tokens, conv.loss_mask, conv.metrics) == state  # the refused message changed nothing
    assert tok.decode(conv.tokens).endswith("<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\n")
