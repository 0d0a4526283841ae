"""How function tools reach a model, whatever its chat template.

An OpenAI-style request carries `tools` (JSON-schema function definitions) beside its messages, and the usual way to
show them to a model is `apply_chat_template(messages, tools=tools)`. Many templates have no tool section: SmolLM2's,
most base models', several older instruct models'. They render exactly the same prompt with or without `tools`, so
the model never sees its tools and nothing says so. astratk checks each template once (`template_renders_tools`:
one message rendered with and without a probe tool) and, where the tools would be lost, renders them itself in one
documented format, `hermes`, the one Hermes and Qwen models are trained on:

- the tools go into the system message (after its own text, or as a new system message) as one JSON object per
  line between `<tools>` and `</tools>`, with a short instruction to answer with calls;
- the model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which the endpoint's
  parser reads back into OpenAI `tool_calls` (`astratk.models.chat.parse_tool_calls`);
- an assistant message that made calls is written back in that form, and tool results (`role: tool`) go into a user
  message as `<tool_response>...</tool_response>`, consecutive results in one message;

so the template itself only ever sees plain system, user and assistant messages.

The format is chosen per env, which owns the chat template (`AgentEnv(tool_format=...)`): `auto` (the default) uses the template where it renders the tools and `hermes` where it drops them;
`template` always uses the template (a model trained on its own tool format); `hermes` always uses the fallback.
A run says at start, per policy, which one its model gets (`describe`).

Example:
    >>> from astratk.models import build_char_tokenizer
    >>> tok = build_char_tokenizer()      # its template has a (compact) tool section
    >>> resolve_tool_format(tok, "auto")
    'template'
    >>> msgs, tools = prepare_messages([{"role": "user", "content": "2+2?"}], [ADD], "hermes")
    >>> tools is None, msgs[0]["role"], "<tools>" in msgs[0]["content"]
    (True, 'system', True)
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TOOL_FORMATS",
    "describe",
    "prepare_messages",
    "resolve_tool_format",
    "template_renders_tools",
    "tool_formats_asked",
    "tool_status",
    "tools_system_text",
]

TOOL_FORMATS = ("auto", "template", "hermes")

# A tool no template has seen: a template renders tools when its name appears in the prompt.
_PROBE_NAME = "astratk_probe_tool_q7"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}

_renders: weakref.WeakKeyDictionary[Any, tuple[Any, bool]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def check_tool_format(value: Any, key: str = "tool_format") -> str:
    """`value` if it names a format, else a one-line error listing the choices."""
    if value not in TOOL_FORMATS:
        raise ValueError(f"{key}: {value!r} is not a tool format; choose one of {list(TOOL_FORMATS)} (auto: the chat "
                         "template where it renders tools, else hermes)")
    return value


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template shows a tool to the model: one user message rendered with a probe tool
    holds the tool's name. A template that raises when given tools counts as dropping them. Cached per tokenizer
    (and re-checked when its template changes)."""
    template = getattr(tokenizer, "chat_template", None)
    with _lock:
        try:
            hit = _renders.get(tokenizer)
        except TypeError:  # cannot be weakly referenced: checked every time
            hit = None
    if hit is not None and hit[0] == template:
        return hit[1]
    msgs = [{"role": "user", "content": "hello"}]
    try:
        text = tokenizer.apply_chat_template(msgs, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
        renders = _PROBE_NAME in text
    except Exception:  # noqa: BLE001 - a template that cannot take tools drops them
        renders = False
    with _lock:
        try:
            _renders[tokenizer] = (template, renders)
        except TypeError:
            pass
    return renders


def resolve_tool_format(tokenizer: Any, requested: str = "auto") -> str:
    """'template' or 'hermes': what `requested` means for this tokenizer (`auto`: the template where it renders
    tools)."""
    check_tool_format(requested)
    if requested != "auto":
        return requested
    return "template" if template_renders_tools(tokenizer) else "hermes"


def tools_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """The system-message section that lists `tools` in the `hermes` format (module docstring)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. Their JSON schemas are listed between <tools> and </tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, write its name and arguments as a JSON object between <tool_call> and </tool_call>, "
            "one call per tag:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>\n'
            "Each result comes back between <tool_response> and </tool_response>.")


def _call_text(call: Any) -> str:
    f = (call or {}).get("function") or {} if isinstance(call, dict) else {}
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # shown as the agent sent it
    return "<tool_call>\n" + json.dumps({"name": f.get("name", ""), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"


def convert_turns(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with tool calls and tool results written in the `hermes` format as plain text: an assistant
    message's `tool_calls` appended to its content as `<tool_call>` blocks, and each run of `tool` messages merged
    into one user message of `<tool_response>` blocks. Other messages pass unchanged (apart from those keys)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            text = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
            continue
        out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("_tool_results", None)
    return out


def prepare_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, fmt: str
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the chat template under format `fmt` ('template' or 'hermes', as resolved): the
    same for 'template'; for 'hermes', the tools in the system message and calls and results as text (module
    docstring), and no `tools` for the template."""
    if fmt == "template":
        return list(messages), (list(tools) if tools else None)
    if fmt != "hermes":
        raise ValueError(f"prepare_messages: resolve the tool format first (template or hermes), got {fmt!r}")
    out = convert_turns(messages)
    if tools:
        section = tools_system_text(tools)
        if out and out[0].get("role") in ("system", "developer"):
            own = out[0].get("content") or ""
            out[0] = {**out[0], "role": "system", "content": f"{own}\n\n{section}" if own else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def tool_formats_asked(env: Any) -> list[str]:
    """The tool formats an env (or a mixture's member envs) asks for: one per env that serves tools to a model
    (it has a `tool_format`), none for envs whose tool protocol is plain text in their prompts."""
    members = list(getattr(env, "envs", {}).values()) if isinstance(getattr(env, "envs", None), dict) else [env]
    return sorted({m.tool_format for m in members if isinstance(getattr(m, "tool_format", None), str)})


def describe(tokenizer: Any, requested: str, who: str) -> str:
    """One line for a run's start: which tool format `who` (a policy and its model) gets, and why."""
    fmt = resolve_tool_format(tokenizer, requested)
    renders = template_renders_tools(tokenizer)
    if fmt == "template":
        why = "its chat template renders them" if renders else (
            "tool_format: template, although its chat template DROPS them: the model will not see its tools")
        return f"tools for {who}: the model's own chat template ({why})"
    why = "its chat template drops them" if not renders else "tool_format: hermes"
    return (f"tools for {who}: hermes fallback ({why}): tools listed in the system message, calls read from "
            "<tool_call>{json}</tool_call>, results sent back as <tool_response>; tool_format: template|hermes "
            "forces one")


def tool_status(env: Any, policy_id: str, model_dir: str) -> tuple[list[str], tuple[bool, str] | None]:
    """For a policy whose env serves tools: the start-up lines (`describe`, one per format asked) and (whether the
    model's prompt shows the tools, the format) of the first; ([], None) for other envs."""
    asked = tool_formats_asked(env)
    if not asked:
        return [], None
    from astratk.models.loading import load_tokenizer

    tok = load_tokenizer(model_dir)
    if tok is None:
        return [], None
    who = f"{policy_id!r} ({Path(model_dir).name})"
    fmt = resolve_tool_format(tok, asked[0])
    shown = fmt == "hermes" or template_renders_tools(tok)
    return [describe(tok, a, who) for a in asked], (shown, fmt)
