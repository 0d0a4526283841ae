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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "encode_chat", "parse_tool_call", "parse_tool_calls", "stop_token_ids"]

# Rendered prompts per tokenizer, most recent last. A group's samples start from the same messages, and rendering the
# template plus encoding costs more than the engine's share of a short sample (measured: 15% of a rollout worker's
# time on the quickstart), so each distinct conversation is encoded once per tokenizer.
_CACHE_SIZE = 4096
_cache: weakref.WeakKeyDictionary[Any, OrderedDict[Any, tuple[int, ...]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Render `messages` with the tokenizer's chat template (generation prompt added) and encode without adding
    special tokens again (the template already holds them). Repeated conversations come from a per-tokenizer cache
    (the key is the template and the messages; messages that are not JSON are encoded every time)."""
    key = _key(tokenizer, messages)
    if key is not None:
        with _lock:
            per_tok = _cache.get(tokenizer)
            ids = per_tok.get(key) if per_tok is not None else None
            if ids is not None:
                per_tok.move_to_end(key)
                return list(ids)
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
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


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Hermes/Qwen-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, in order. Malformed JSON
    or a missing name gives a `ToolCall` with `error` set, so the env can answer it instead of silently ignoring it."""
    return [parse_tool_call(m.group(1)) for m in _TOOL_CALL.finditer(text)]


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
