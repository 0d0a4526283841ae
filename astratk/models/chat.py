"""Chat encoding: a tokenizer's chat template to token ids, and the tokens that end an assistant turn.

It lives beside the models (not the envs) because the core needs it too: the warm start encodes an env's messages
exactly as the env's episodes do, so the tiny model learns the prompts it will be sampled on. The env owns the
template; engines see token ids only.

Example:
    >>> from astratk.models import build_char_tokenizer
    >>> tok = build_char_tokenizer()
    >>> tok.decode(encode_chat(tok, [{"role": "user", "content": "1+1="}]))
    '<|im_start|>user\\n1+1=<|im_end|>\\n<|im_start|>assistant\\n'
    >>> [tok.convert_ids_to_tokens(i) for i in stop_token_ids(tok)]
    ['<|im_end|>', '<|endoftext|>']
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from astratk.models.tools import convert_turns, prepare_messages, resolve_tool_format

__all__ = ["ChatTurns", "ToolCall", "chat_turns", "encode_chat", "parse_tool_call", "parse_tool_calls", "stop_token_ids"]

# Rendered prompts per tokenizer, most recent last. A group's samples start from the same messages, and rendering the
# template plus encoding costs more than the engine's share of a short sample (measured: 15% of a rollout worker's
# time on the quickstart), so each distinct conversation is encoded once per tokenizer.
_CACHE_SIZE = 4096
_cache: weakref.WeakKeyDictionary[Any, OrderedDict[Any, tuple[int, ...]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                tool_format: str = "auto") -> list[int]:
    """Render `messages` with the tokenizer's chat template (generation prompt added; `tools`, OpenAI-style function
    definitions, shown to the model as `tool_format` says: the template where it renders them, else the `hermes`
    fallback, `astratk.models.tools`) and encode without adding special tokens again (the template already holds
    them). Repeated conversations come from a per-tokenizer cache (the key is the template, the messages and the
    tools; what is not JSON is encoded every time)."""
    if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        messages, tools = prepare_messages(messages, tools, resolve_tool_format(tokenizer, tool_format))
    key = _key(tokenizer, messages) if not tools else _key(tokenizer, [*messages, {"tools": json.dumps(
        tools, sort_keys=True, default=repr)}])
    if key is not None:
        with _lock:
            per_tok = _cache.get(tokenizer)
            ids = per_tok.get(key) if per_tok is not None else None
            if ids is not None:
                per_tok.move_to_end(key)
                return list(ids)
    extra = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    if key is not None:
        with _lock:
            try:
                per_tok = _cache.setdefault(tokenizer, OrderedDict())
            except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
                return list(ids)
            per_tok[key] = ids
            while len(per_tok) > _CACHE_SIZE:
                per_tok.popitem(last=False)
    return list(ids)


def _key(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> Any:
    """A hashable key for (template, messages): their items as tuples (plain string messages), else their JSON; None
    when neither works (not cached)."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        key = (template, tuple(tuple(sorted(m.items())) for m in messages))
        hash(key)
        return key
    except (TypeError, AttributeError):
        pass
    try:
        return (template, json.dumps(list(messages), sort_keys=True))
    except (TypeError, ValueError):
        return None


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """End-of-turn and end-of-text ids: a completion ends at whichever the model emits first."""
    ids = []
    for token in ("<|im_end|>", tokenizer.eos_token):
        if token is None:
            continue
        i = tokenizer.convert_tokens_to_ids(token)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i not in ids:
            ids.append(i)
    return tuple(ids)


# ------------------------------------------------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from a generation. `error` is set (and `name` may be empty) when the call is malformed."""

    name: str
    arguments: Any = None
    raw: str = ""
    error: str = ""


_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Hermes/Qwen-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, in order. Malformed JSON,
    a missing name, or a `<tool_call>` tag never closed (a generation cut off mid-call) gives a `ToolCall` with
    `error` set, so the env can count and answer it instead of silently treating it as text."""
    calls, end = [], 0
    for m in _TOOL_CALL.finditer(text):
        calls.append(parse_tool_call(m.group(1)))
        end = m.end()
    tail = text.find(_OPEN, end)
    if tail >= 0:
        calls.append(ToolCall("", None, text[tail + len(_OPEN):].strip(), "a <tool_call> tag that is never closed "
                              "(the generation ended mid-call: raise the token budget)"))
    return calls


def parse_tool_call(raw: str) -> ToolCall:
    """One call's JSON, the content of a `<tool_call>` tag (see `parse_tool_calls`)."""
    raw = raw.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", None, raw, f"invalid JSON: {e.msg} at {e.pos}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", None, raw, 'a tool call needs {"name": "...", "arguments": {...}}')
    return ToolCall(obj["name"], obj.get("arguments", {}), raw)


# ------------------------------------------------------------------------------------------------ turn rendering


class ChatTurns:
    """Token ids that follow an assistant turn for a new message, derived from the tokenizer's chat template.

    For a template that renders `... <assistant content><close>` and then `<open role>content<close>` and the
    generation prompt, `close` is what follows the content (e.g. "<|im_end|>\\n") and `continuation(role, content)`
    is the rest: the part of `close` the model did not produce, the new message, and the next generation prompt.

    Tool results (`role: tool`) are written as `encode_chat` writes them, so an episode's turns and the warm start's
    demonstrations give the model the same tokens: under `tool_format` `hermes` (what `auto` picks for a template
    without a tool section, e.g. SmolLM2's) they become a user message of `<tool_response>` blocks; under `template`
    the template renders the role itself.
    """

    _PROBE = "\x07astratk-probe\x07"

    def __init__(self, tokenizer: Any, tool_format: str = "auto", *, weak: bool = False) -> None:
        # weak: held by a weak reference only (the process's shared cache, `chat_turns`, which must not keep a
        # tokenizer alive); whoever uses it holds the tokenizer itself (a Conversation does)
        self._tokenizer: Any = None if weak else tokenizer
        self._tokenizer_ref = weakref.ref(tokenizer)
        self.tool_format = tool_format
        self._results_as_text: bool | None = None
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": self._PROBE}]
        rendered = tokenizer.apply_chat_template(base, tokenize=False)
        at = rendered.rfind(self._PROBE)
        if at < 0:
            raise ValueError("the chat template drops assistant content; multi-turn envs need one that keeps it")
        self._base, self.close = rendered, rendered[at + len(self._PROBE):]
        self._cache: dict[str, tuple[str, str]] = {}
        self._frames: dict[tuple[str, str, str], list[int]] = {}

    @property
    def tokenizer(self) -> Any:
        tok = self._tokenizer if self._tokenizer is not None else self._tokenizer_ref()
        if tok is None:
            raise RuntimeError("ChatTurns: its tokenizer was garbage-collected; hold the tokenizer while using it")
        return tok

    def _frame(self, role: str) -> tuple[str, str]:
        """(text before the message content, text after it up to and including the generation prompt)."""
        if role not in self._cache:
            probe = self._PROBE + "m"
            msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": self._PROBE},
                    {"role": role, "content": probe}]
            full = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            if not full.startswith(self._base) or full.count(probe) != 1:
                raise ValueError(f"the chat template does not render a {role!r} message after an assistant turn as "
                                 "a plain continuation; multi-turn envs need a template with fixed turn separators")
            rest = full[len(self._base):]
            i = rest.index(probe)
            self._cache[role] = (rest[:i], rest[i + len(probe):])
        return self._cache[role]

    def _tool_results_as_text(self) -> bool:
        """Whether tool results are written in the hermes format (resolved once, on first use)."""
        if self._results_as_text is None:
            self._results_as_text = resolve_tool_format(self.tokenizer, self.tool_format) == "hermes"
        return self._results_as_text

    def frame_tokens(self, role: str, produced_close: str, encode: Any) -> list[int]:
        """Token ids of an empty message's continuation (cached): the overhead a message adds around its content."""
        key = ("frame", role, produced_close)
        if key not in self._frames:
            self._frames[key] = encode(self.continuation(role, "", produced_close))
        return self._frames[key]

    def continuation(self, role: str, content: str, produced_close: str) -> str:
        """Text to append after an assistant completion whose text ended with `produced_close` (the part of
        `close` the model emitted, e.g. its stop token "<|im_end|>"; "" if it was cut off)."""
        if role == "tool" and self._tool_results_as_text():
            (message,) = convert_turns([{"role": role, "content": content}])
            role, content = message["role"], message["content"]
        if not self.close.startswith(produced_close):
            produced_close = ""
        before, after = self._frame(role)
        return self.close[len(produced_close):] + before + content + after

    def continuation_of(self, messages: Sequence[Mapping[str, str]], produced_close: str) -> str:
        """`continuation` for several messages in a row, rendered together by the template (which may merge them)."""
        if any(m["role"] == "tool" for m in messages) and self._tool_results_as_text():
            messages = convert_turns([{"role": m["role"], "content": m["content"]} for m in messages])
        if len(messages) == 1:
            return self.continuation(messages[0]["role"], messages[0]["content"], produced_close)
        for m in messages:
            self._frame(m["role"])  # each role must render as a plain continuation (raises the clear error)
        head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": self._PROBE}]
        try:
            full = self.tokenizer.apply_chat_template(head + [dict(m) for m in messages], tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # e.g. templates that insist on alternating roles raise jinja2's TemplateError
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template cannot render the messages {roles} in a row after an assistant turn "
                             f"({type(e).__name__}: {e}); send the env's output as one message per turn, or use a "
                             "template that accepts consecutive messages") from e
        if not full.startswith(self._base):
            raise ValueError("the chat template does not render several messages after an assistant turn as a plain "
                             "continuation; multi-turn envs need a template with fixed turn separators")
        if not self.close.startswith(produced_close):
            produced_close = ""
        return self.close[len(produced_close):] + full[len(self._base):]


# One ChatTurns per tokenizer and tool format in a process: deriving one renders the chat template several times
# (~ms) and its frames are cached inside it, so every env and session of a worker shares them. Weakly keyed: a
# tokenizer that goes away takes its entry with it (an id() key could be reused by a new tokenizer).
_turns: weakref.WeakKeyDictionary[Any, dict[str, ChatTurns]] = weakref.WeakKeyDictionary()


def chat_turns(tokenizer: Any, tool_format: str = "auto") -> ChatTurns:
    """The process's `ChatTurns` of `tokenizer` under `tool_format` (built on first use)."""
    with _lock:
        found = _turns.get(tokenizer, {}).get(tool_format)
    if found is not None:
        return found
    built = ChatTurns(tokenizer, tool_format=tool_format, weak=True)  # outside the lock: it renders the template
    with _lock:
        return _turns.setdefault(tokenizer, {}).setdefault(tool_format, built)
