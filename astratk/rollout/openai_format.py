"""The OpenAI chat-completions wire format, as the endpoint (`astratk.rollout.openai_api`) speaks it: a request body
checked and turned into sampling parameters (`parse_request`), refusals as OpenAI error bodies (`RequestError`), and a
sampled completion written back as an OpenAI choice (`choice`), Hermes/Qwen-style tool calls parsed out of the text.

A new request field is read and checked in `parse_request` (a `RequestError` naming it when malformed) and carried on
`ChatRequest`; a new answer field is written in `choice`.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion, SamplingParams
from astratk.models.chat import _TOOL_CALL, parse_tool_call

MAX_N = 128
MAX_STOP = 4
INT64 = 1 << 63


class RequestError(Exception):
    """A request the endpoint refuses: OpenAI's status code, message, error type, parameter and code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked chat-completions request: its messages and tools, the sampling asked for, what to answer with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: SamplingParams
    logprobs: bool
    top_logprobs: int
    parse_tools: bool
    extra: dict[str, Any] = field(default_factory=dict)
    given: frozenset[str] = frozenset()  # the sampling fields the request set itself (temperature, max_tokens)
    stream: bool = False  # answer as Server-Sent Events (astratk.rollout.openai_stream)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts


def _number(body: dict[str, Any], key: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi or (isinstance(value, float) and math.isnan(value)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{key}' must be {kind} in [{lo:g}, {hi:g}], got {value!r}", param=key)
    return value


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # the roles OpenAI's API takes


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's `tool_calls`: a list of {"id": str, "type": "function", "function": {"name": str,
    "arguments": str or object}}, as OpenAI's API takes them."""
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list of tool calls", param=where)
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(f, dict) or not isinstance(f.get("name"), str)
                or not isinstance(c.get("id", ""), str) or not isinstance(f.get("arguments", ""), (str, dict))):
            raise RequestError(400, f"{where}.tool_calls[{j}] must be an object with a string 'id' and a 'function' "
                               "object with a string 'name' and 'arguments' (a JSON string or an object)", param=where)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        if m["role"] not in ROLES:
            raise RequestError(400, f"Invalid value: {m['role']!r}. messages[{i}].role must be one of "
                               f"{', '.join(ROLES)}", param=f"messages[{i}].role", code="invalid_value")
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], f"messages[{i}]")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise RequestError(400, f"messages[{i}].{key} must be a string", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise RequestError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                   "<string>}) are supported", param=f"messages[{i}]")
            m = {**m, "content": "".join(texts)}
        elif content is None and not m.get("tool_calls"):
            raise RequestError(400, f"messages[{i}] has no 'content'", param=f"messages[{i}]")
        elif content is not None and not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}]")
        out.append(dict(m))
    return out


def parse_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """The chat-completions body as sampling parameters; a RequestError for anything malformed."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        json.dumps(body).encode("utf-8")  # lone surrogates ("\\ud800") cannot be tokenised
    except UnicodeEncodeError as e:
        raise RequestError(400, f"the request holds text that is not valid Unicode: {e}") from None
    messages = _check_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "'tools' must be a list of tool objects", param="tools")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    max_tokens = body.get("max_completion_tokens")
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    max_tokens = default_max_tokens if max_tokens is None else _number(
        {"max_tokens": max_tokens}, "max_tokens", None, 1, 1 << 20, integer=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings",
                           param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -INT64 <= seed < INT64):
        raise RequestError(400, f"'seed' must be a 64-bit integer, got {seed!r}", param="seed")
    logprobs = body.get("logprobs")
    logprobs = False if logprobs is None else logprobs
    if not isinstance(logprobs, bool):
        raise RequestError(400, "'logprobs' must be true or false", param="logprobs")
    top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
    if top and not logprobs:
        raise RequestError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    stream, include_usage = _stream_options(body)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, top_k_logprobs=top,
                            stop=tuple(stops), n=n)
    parse_tools = bool(tools) and body.get("tool_choice") != "none"
    given = frozenset(k for k, present in (("temperature", body.get("temperature") is not None),
                                           ("max_tokens", body.get("max_tokens") is not None
                                            or body.get("max_completion_tokens") is not None)) if present)
    return ChatRequest(messages, tools or None, params, logprobs, top, parse_tools, given=given, stream=stream,
                       include_usage=include_usage)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`), checked as OpenAI checks them."""
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool) or not isinstance(options, dict) or set(options) - {"include_usage",
                                                                                         "include_obfuscation"}:
        raise RequestError(400, "'stream_options' must be an object like {\"include_usage\": true}",
                           param="stream_options")
    return stream, usage


def _tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, OpenAI tool_calls) of a generation with Hermes/Qwen-style calls."""

    calls, kept, end = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        call = parse_tool_call(match.group(1))
        if call.error:
            continue  # a malformed call stays in the content, where the agent can see it
        args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call.name, "arguments": args}})
        kept.append(text[end:match.start()])
        end = match.end()
    if not calls:
        return text, []
    content = "".join([*kept, text[end:]]).strip()  # the text around the parsed calls (malformed ones included)
    return (content or None), calls


def choice(tok: Any, index: int, c: Completion, parsed: ChatRequest) -> dict[str, Any]:
    """One sample as an OpenAI choice: the text (tool calls parsed when the request had tools), log-probs if asked."""
    text = tok.decode(list(c.token_ids), skip_special_tokens=True)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = c.finish_reason
    if parsed.parse_tools:
        content, calls = _tool_calls(text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = "tool_calls"
    out: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if parsed.logprobs:
        entries = []
        for j, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            piece = tok.decode([tid])
            entry: dict[str, Any] = {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
            if parsed.top_logprobs and c.topk_ids:
                entry["top_logprobs"] = [
                    {"token": tok.decode([i]), "logprob": p, "bytes": list(tok.decode([i]).encode())}
                    for i, p in zip(c.topk_ids[j][:parsed.top_logprobs], c.topk_logprobs[j][:parsed.top_logprobs],
                                    strict=True)]
            else:
                entry["top_logprobs"] = []
            entries.append(entry)
        out["logprobs"] = {"content": entries}
    return out
