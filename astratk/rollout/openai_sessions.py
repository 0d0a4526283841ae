"""Session capture for the OpenAI endpoint: every chat call recorded in token space per session (`CapturedCall`), the
sampling a training run imposes on a session, and prompts that reuse a session's earlier turns token for token (only
the messages after the reused turn are rendered with the chat template).

`SessionCapture` knows no HTTP: `_complete` takes a checked request and returns the OpenAI answer; the endpoint
(`astratk.rollout.openai_api`) serves it. A new per-session rule goes on `Session` and into `_sampling`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion, GenerationRequest, SamplingParams
from astratk.models.chat import chat_turns, stop_token_ids
from astratk.models.tools import check_tool_format, convert_turns, prepare_messages, resolve_tool_format
from astratk.rollout.openai_format import ChatRequest, RequestError, choice

DEFAULT_SESSION = "default"
MAX_TURNS = 4096  # reusable turns remembered per session (the oldest go first)


@dataclass(frozen=True)
class CapturedCall:
    """One chat-completions call as the engine saw it: the rendered prompt's ids and each sample's completion (token
    ids, log-probs of the distribution sampled, the weight version of each token, why it ended)."""

    session: str
    call_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: tuple[int, ...]
    completions: tuple[Completion, ...]
    started: float
    latency_s: float
    # the call whose prompt + completion this prompt extends token for token (its earlier assistant turn reused as
    # sampled), or None when the whole prompt was rendered by the chat template
    extends: str | None = None
    # the choice of `extends` that was continued
    extends_choice: int = 0


@dataclass
class Turn:
    """A choice this endpoint answered: what a later request must repeat before it for its tokens to be reused."""

    call_id: str
    choice: int
    history: list[dict[str, Any]]  # the normalised messages it answered
    tools: str  # the tools it was given, as canonical JSON
    prompt: tuple[int, ...]
    completion: Completion


@dataclass
class Session:
    """One episode's view of the endpoint: its engine (None: the endpoint's), the event loop that engine runs on (None:
    the server's), sampling the run imposes (a temperature, a seed per call, a cap on new tokens, a context), its
    calls, and the turns a later call may reuse."""

    engine: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    temperature: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    max_context: int | None = None
    top_k_logprobs: int = 0
    tool_format: str | None = None  # None: the endpoint's
    calls: list[CapturedCall] = field(default_factory=list)
    turns: dict[Any, Turn] = field(default_factory=dict)
    overridden: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    opened: bool = False  # by `open_session` (a training episode): its calls record exactly `top_k_logprobs`
    issued: int = 0  # calls issued so far (the k-th call's seed), counted before they generate


class SessionCapture:
    """The sessions of an endpoint over `engine` (None: opened sessions only) and how a call is answered and captured
    in one of them (`OpenAIEndpoint`'s docstring: sessions, reused turns)."""

    def __init__(self, engine: Any, model: str, *, max_model_len: int | None, default_max_tokens: int,
                 keep_calls: int, max_sessions: int, tool_format: str = "auto") -> None:
        self.engine = engine
        self.tool_format = check_tool_format(tool_format)
        self.model = model
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.keep_calls = keep_calls
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._closed: set[str] = set()
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "errors": 0, "completion_tokens": 0, "prompt_tokens": 0, "reused_turns": 0,
                      "rendered_prompts": 0, "streamed": 0, "stream_disconnects": 0, "shed": 0, "max_inflight_seen": 0,
                      "unserved": 0}

    # --------------------------------------------------------------------------------------------- sessions
    def register_session(self, session: str, engine: Any = None, *, loop: asyncio.AbstractEventLoop | None = None,
                         temperature: float | None = None, seed: int | None = None, max_tokens: int | None = None,
                         max_context: int | None = None, top_k_logprobs: int = 0, tool_format: str | None = None
                         ) -> None:
        """Serve `session` with its own engine and sampling rules (`OpenAIEndpoint.open_session`)."""
        if engine is None and self.engine is None:
            raise ValueError(f"session {session!r}: give an engine (this endpoint has none of its own)")
        if tool_format is not None:
            check_tool_format(tool_format)
        with self._lock:
            if session in self._sessions:
                raise ValueError(f"session {session!r} is already open")
            self._closed.discard(session)
            self._sessions[session] = Session(engine, loop, temperature, seed, max_tokens, max_context,
                                              top_k_logprobs, tool_format, opened=True)

    def close_session(self, session: str) -> list[CapturedCall]:
        """Stop serving `session` (its later requests get 404) and return its calls."""
        with self._lock:
            sess = self._sessions.pop(session, None)
            self._closed.add(session)
            if len(self._closed) > self.keep_calls:
                self._closed.clear()  # bounded memory; a request of a long-closed session then opens a new one
        return list(sess.calls) if sess is not None else []

    def session_stats(self, session: str) -> dict[str, int]:
        """Requests whose asked-for sampling the session overrode, by field."""
        with self._lock:
            sess = self._sessions.get(session)
            return dict(sess.overridden) if sess is not None else {}

    def calls(self, session: str = DEFAULT_SESSION) -> list[CapturedCall]:
        with self._lock:
            sess = self._sessions.get(session)
            return list(sess.calls) if sess is not None else []

    def pop_session(self, session: str) -> list[CapturedCall]:
        """The session's calls, forgotten here; the session stays servable (`close_session` also ends it)."""
        with self._lock:
            sess = self._sessions.pop(session, None)
            return list(sess.calls) if sess is not None else []

    def _session(self, session: str) -> Session:
        with self._lock:
            sess = self._sessions.get(session)
            if sess is not None:
                return sess
            if session in self._closed:
                raise RequestError(404, f"session {session!r} has ended (its episode is over)", code="session_closed")
            if self.engine is None:
                raise RequestError(404, f"no session {session!r}: this endpoint serves opened sessions only",
                                   code="session_not_found")
            if len(self._sessions) >= self.max_sessions:  # each session path a client invents holds memory
                raise RequestError(429, f"too many open sessions ({len(self._sessions)}); end some (close_session) "
                                   "or raise max_sessions", code="too_many_sessions", kind="rate_limit_error")
            sess = self._sessions[session] = Session()
            return sess

    def _record(self, sess: Session, call: CapturedCall) -> None:
        with self._lock:
            sess.calls.append(call)
            total = sum(len(v.calls) for v in self._sessions.values())
            if total > self.keep_calls:  # bounded memory for a long-lived endpoint: the oldest call goes
                oldest = min((v for v in self._sessions.values() if v.calls), key=lambda v: v.calls[0].started)
                oldest.calls.pop(0)

    # --------------------------------------------------------------------------------------------- prompts
    def _chat_turns(self, tok: Any) -> Any:
        return chat_turns(tok, tool_format="template")  # the session converts its messages itself

    def tool_format_of(self, sess: Session, tok: Any) -> str:
        """'template' or 'hermes': how `sess`'s tools reach the model of `tok` (`astratk.models.tools`)."""
        return resolve_tool_format(tok, sess.tool_format or self.tool_format)

    def _render(self, tok: Any, parsed: ChatRequest, fmt: str) -> tuple[int, ...]:
        messages, tools = prepare_messages([_for_template(m) for m in parsed.messages], parsed.tools, fmt)
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise RequestError(400, f"the model's chat template cannot render these messages: {e}",
                               param="messages") from None
        return tuple(tok(text, add_special_tokens=False)["input_ids"])

    def _prompt(self, sess: Session, tok: Any, parsed: ChatRequest, tools: str) -> tuple[tuple[int, ...], Turn | None]:
        """The prompt's ids and the earlier turn it extends (`OpenAIEndpoint`'s docstring), or the template's
        rendering and None."""
        msgs = parsed.messages
        fmt = self.tool_format_of(sess, tok)
        last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        turn = sess.turns.get(_turn_key(msgs[last])) if last is not None else None
        rest = msgs[last + 1:] if last is not None else []
        if (turn is not None and rest and turn.tools == tools and all(m["role"] != "assistant" for m in rest)
                and [_normalise(m) for m in msgs[:last]] == turn.history):
            after = convert_turns(rest) if fmt == "hermes" else rest  # tool results as the fallback writes them
            try:
                text = self._chat_turns(tok).continuation_of(
                    [{"role": m["role"], "content": m.get("content") or ""} for m in after],
                    _produced_close(tok, turn.completion))
            except Exception:  # noqa: BLE001 - no fixed turn separators, or a template that refuses the roles: the
                return self._render(tok, parsed, fmt), None  # whole conversation rendered (a 400 if it cannot be)
            ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
            return turn.prompt + tuple(turn.completion.token_ids) + ids, turn
        return self._render(tok, parsed, fmt), None

    # --------------------------------------------------------------------------------------------- calls
    async def _complete(self, parsed: ChatRequest, session: str, sess: Session
                        ) -> tuple[dict[str, Any], tuple[Completion, ...]]:
        """Answer a checked request in `session`: generate, record the call, remember its turns; the OpenAI body
        and the completions it was written from (a stream cuts their text at token boundaries)."""
        engine = sess.engine if sess.engine is not None else self.engine
        tok = engine.tokenizer
        tools = json.dumps(parsed.tools, sort_keys=True)
        prompt, extended = self._prompt(sess, tok, parsed, tools)
        self.stats["reused_turns" if extended is not None else "rendered_prompts"] += 1
        params = _sampling(sess, parsed, prompt, tok, [self.max_model_len, sess.max_context,
                                                       getattr(engine, "max_model_len", None)])
        started = time.time()
        completions = await _generate(engine, sess, session, GenerationRequest(prompt, params))
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        captured = completions if not sess.opened else tuple(  # a training episode records exactly its K per token
            _top_k(c, sess.top_k_logprobs) for c in completions)
        call = CapturedCall(session, call_id, parsed.messages, parsed.tools, prompt, captured, started,
                            time.time() - started, extended.call_id if extended is not None else None,
                            extended.choice if extended is not None else 0)
        self._record(sess, call)
        choices = [choice(tok, i, c, parsed) for i, c in enumerate(completions)]
        history = [_normalise(m) for m in parsed.messages]
        for i, (answer, c) in enumerate(zip(choices, captured, strict=True)):
            sess.turns[_turn_key(answer["message"])] = Turn(call_id, i, history, tools, prompt, c)
        while len(sess.turns) > MAX_TURNS:
            del sess.turns[next(iter(sess.turns))]
        used = sum(len(c.token_ids) for c in completions)
        self.stats["completion_tokens"] += used
        self.stats["prompt_tokens"] += len(prompt)
        return {"id": call_id, "object": "chat.completion", "created": int(started), "model": self.model,
                "choices": choices, "system_fingerprint": None,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": used,
                          "total_tokens": len(prompt) + used}}, completions


def _sampling(sess: Session, parsed: ChatRequest, prompt: tuple[int, ...], tok: Any,
              contexts: list[int | None]) -> SamplingParams:
    """The request's sampling under the session's rules (overrides counted), its budget fitted into the smallest of
    `contexts` (a 400 when the prompt fills it), stopping at the template's end-of-turn tokens."""
    params = parsed.params
    if sess.temperature is not None and params.temperature != sess.temperature:
        if "temperature" in parsed.given:  # a request that sent none takes the run's without an override
            sess.overridden["temperature"] += 1
        params = dataclasses.replace(params, temperature=sess.temperature)
    k, sess.issued = sess.issued, sess.issued + 1  # counted before generating: concurrent calls differ
    if params.seed is None and sess.seed is not None:
        params = dataclasses.replace(params, seed=sess.seed + 7919 * k)
    if sess.max_tokens is not None and "max_tokens" not in parsed.given:
        params = dataclasses.replace(params, max_tokens=sess.max_tokens)  # the run's budget, not the default
    elif sess.max_tokens is not None and params.max_tokens > sess.max_tokens:
        sess.overridden["max_tokens"] += 1
        params = dataclasses.replace(params, max_tokens=sess.max_tokens)
    if sess.top_k_logprobs > params.top_k_logprobs:
        params = dataclasses.replace(params, top_k_logprobs=sess.top_k_logprobs)
    limits = [x for x in contexts if x]
    if limits:
        limit = int(min(limits))
        room = limit - len(prompt)
        if room < 1:
            raise RequestError(400, f"This model's maximum context length is {limit} tokens. However, your "
                               f"messages resulted in {len(prompt)} tokens.", param="messages",
                               code="context_length_exceeded")
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
    return dataclasses.replace(params, stop_token_ids=stop_token_ids(tok))


async def _generate(engine: Any, sess: Session, session: str, request: GenerationRequest) -> tuple[Completion, ...]:
    """The engine's completions, generated on the session's event loop when it has one of its own."""
    work = engine.generate([request])
    if sess.loop is not None and sess.loop is not asyncio.get_running_loop():
        if sess.loop.is_closed():
            raise RequestError(404, f"session {session!r} has ended (its event loop is closed)",
                               code="session_closed")
        return tuple(await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, sess.loop)))
    return tuple(await work)


def _normalise(m: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that change what the model sees (the `openai` client adds `refusal`, `audio`... as None)."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [(c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                             for c in calls if isinstance(c, dict)]
    for key in ("tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def _turn_key(m: dict[str, Any]) -> Any:
    """How a returned assistant message is recognised when an agent sends it back: its tool-call ids (unique per
    answer), else its text."""
    calls = m.get("tool_calls")
    if calls:
        return ("calls", tuple(c.get("id") for c in calls if isinstance(c, dict)))
    return ("text", m.get("content") or "")


def _for_template(m: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: tool-call arguments as objects (OpenAI sends JSON strings; Qwen's
    template, for one, would encode them again)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    fixed = []
    for c in calls:
        f = dict((c or {}).get("function") or {})
        if isinstance(f.get("arguments"), str):
            try:
                f["arguments"] = json.loads(f["arguments"])
            except json.JSONDecodeError:
                pass  # left as sent: the template shows what the agent wrote
        fixed.append({**c, "function": f})
    return {**m, "tool_calls": fixed}


def _top_k(c: Completion, k: int) -> Completion:
    """`c` with exactly `k` alternatives per token recorded (none for k = 0), whatever width the request asked for."""
    if not c.topk_ids or all(len(row) == k for row in c.topk_ids):
        return c
    if k == 0:
        return dataclasses.replace(c, topk_ids=(), topk_logprobs=())
    return dataclasses.replace(c, topk_ids=tuple(r[:k] for r in c.topk_ids),
                               topk_logprobs=tuple(r[:k] for r in c.topk_logprobs))


def _produced_close(tok: Any, c: Completion) -> str:
    """The end-of-turn token a completion ended with ("" when it was cut off or stopped by a stop string)."""
    if c.finish_reason != "stop" or not c.token_ids:
        return ""
    return tok.convert_ids_to_tokens(c.token_ids[-1]) or ""

