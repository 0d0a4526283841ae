"""An OpenAI-compatible HTTP endpoint over one of astratk's engines, recording every call in token space.

Agents written against the OpenAI chat API (the `openai` client, LangGraph, smolagents...) talk to
`OpenAIEndpoint.base_url` as to any OpenAI server: `GET /v1/models` and `POST /v1/chat/completions` (`messages`,
`n`, `temperature`, `max_tokens` / `max_completion_tokens`, `stop`, `seed`, `logprobs` / `top_logprobs`, `tools`).
The endpoint renders the messages with the model's own chat template (tools passed to it), generates with the
engine, and answers in OpenAI's format, tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the
generated text, Hermes/Qwen style) as `tool_calls`.

What makes it a training tool: each call is captured **in token space**, per session: the prompt ids the engine was
given, and per sample the completion ids, their log-probs under the distribution sampled and the weight version that
produced each token (`CapturedCall`). A trajectory built from them is exactly what was sampled: nothing is
re-tokenised. Sessions are told apart by the URL: `session_url(id)` is `<root>/s/<id>/v1`, so concurrent episodes
each get their own `base_url` and their calls never mix. `open_session` gives a session its own engine (run on the
event loop that engine belongs to) and the sampling a training run imposes; within a session, a request that sends
back an assistant message this endpoint returned reuses that turn's prompt and completion tokens as they were
sampled, and only the messages after it are rendered (`OpenAIEndpoint`'s docstring). `astratk.envs.agent.AgentEnv`
builds on this to train agents written against the OpenAI API.

It binds to 127.0.0.1 by default; with `api_key` set every request must carry `Authorization: Bearer <api_key>`
(what the `openai` client sends). Bad requests get OpenAI-style error bodies (`{"error": {"message", "type",
"param", "code"}}`) with the usual status codes, never a crash of the server; a prompt beyond the model's context is
refused with the token counts (`context_length_exceeded`).

Example:
    >>> endpoint = OpenAIEndpoint(engine, model="policy").start()  # doctest: +SKIP
    >>> from openai import OpenAI  # doctest: +SKIP
    >>> client = OpenAI(base_url=endpoint.session_url("episode-1"), api_key="unused")  # doctest: +SKIP
    >>> reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2="}])
    ...  # doctest: +SKIP
    >>> endpoint.calls("episode-1")[0].completions[0].token_ids  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion, GenerationRequest, SamplingParams
from astratk.models.chat import _TOOL_CALL, ChatTurns, parse_tool_call, stop_token_ids

MAX_N = 128
MAX_STOP = 4
DEFAULT_SESSION = "default"
MAX_TURNS = 4096  # reusable turns remembered per session (the oldest go first)
INT64 = 1 << 63


class RequestError(Exception):
    """A request the endpoint refuses: OpenAI's status code, message, error type, parameter and code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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
class _Turn:
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
    calls: list[CapturedCall] = field(default_factory=list)
    turns: dict[Any, _Turn] = field(default_factory=dict)
    overridden: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    opened: bool = False  # by `open_session` (a training episode): its calls record exactly `top_k_logprobs`
    issued: int = 0  # calls issued so far (the k-th call's seed), counted before they generate


@dataclass
class _Parsed:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: SamplingParams
    logprobs: bool
    top_logprobs: int
    parse_tools: bool
    extra: dict[str, Any] = field(default_factory=dict)
    given: frozenset[str] = frozenset()  # the sampling fields the request set itself (temperature, max_tokens)


def _number(body: dict[str, Any], key: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi or (isinstance(value, float) and math.isnan(value)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{key}' must be {kind} in [{lo:g}, {hi:g}], got {value!r}", param=key)
    return value


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


def parse_request(body: Any, default_max_tokens: int) -> _Parsed:
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
    if body.get("stream"):
        raise RequestError(400, "streaming is not supported by this endpoint; send stream: false", param="stream")
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, top_k_logprobs=top,
                            stop=tuple(stops), n=n)
    parse_tools = bool(tools) and body.get("tool_choice") != "none"
    given = frozenset(k for k, present in (("temperature", body.get("temperature") is not None),
                                           ("max_tokens", body.get("max_tokens") is not None
                                            or body.get("max_completion_tokens") is not None)) if present)
    return _Parsed(messages, tools or None, params, logprobs, top, parse_tools, given=given)


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


def _choice(tok: Any, index: int, c: Completion, parsed: _Parsed) -> dict[str, Any]:
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
        for j, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            piece = tok.decode([tid])
            entry: dict[str, Any] = {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
            if parsed.top_logprobs and c.topk_ids:
                entry["top_logprobs"] = [
                    {"token": tok.decode([i]), "logprob": p, "bytes": list(tok.decode([i]).encode())}
                    for i, p in zip(c.topk_ids[j][:parsed.top_logprobs], c.topk_logprobs[j][:parsed.top_logprobs])]
            else:
                entry["top_logprobs"] = []
            entries.append(entry)
        out["logprobs"] = {"content": entries}
    return out


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


class OpenAIEndpoint:
    """`/v1/models` and `/v1/chat/completions` over `engine` (module docstring). `start()` serves on a thread of its
    own; `close()` stops it.

    Sessions: `open_session(id, engine, loop=...)` gives an episode its own engine (e.g. the rollout service's, which
    runs on that episode's event loop: calls are handed to `loop`), its sampling rules and its record of calls;
    `close_session(id)` returns the calls and refuses any later request of that session. Without `engine` here, only
    opened sessions are served. A session's prompts reuse its earlier turns token for token: when a request repeats
    an assistant message this endpoint returned (found by its tool-call ids, or its text), with the same messages
    before it and the same tools, the prompt is that call's prompt + the completion as sampled + the template's
    rendering of the messages after it, so the agent's re-serialised history never re-tokenises what was sampled.
    """

    def __init__(self, engine: Any = None, model: str = "astratk", *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_model_len: int | None = None, default_max_tokens: int = 256,
                 keep_calls: int = 100_000, max_sessions: int = 10_000) -> None:
        self.engine = engine
        self.model = model
        self.host, self.port = host, port
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.keep_calls = keep_calls
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._closed: set[str] = set()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._thread: threading.Thread | None = None
        self._turns_api: dict[int, tuple[Any, Any]] = {}
        self.stats = {"requests": 0, "errors": 0, "completion_tokens": 0, "prompt_tokens": 0, "reused_turns": 0,
                      "rendered_prompts": 0}

    # --------------------------------------------------------------------------------------------- addresses
    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def session_url(self, session: str) -> str:
        """The base URL whose calls are recorded under `session` (one per episode)."""
        if not session or "/" in session:
            raise ValueError(f"a session id must be non-empty and contain no '/', got {session!r}")
        return f"{self.root}/s/{session}/v1"

    # --------------------------------------------------------------------------------------------- sessions
    def open_session(self, session: str, engine: Any = None, *, loop: asyncio.AbstractEventLoop | None = None,
                     temperature: float | None = None, seed: int | None = None, max_tokens: int | None = None,
                     max_context: int | None = None, top_k_logprobs: int = 0) -> str:
        """Serve `session` with `engine` (default: the endpoint's) on `loop`; returns its base URL. `temperature`
        overrides what requests ask for (counted in `session_stats`), `seed` seeds the k-th call with seed + 7919·k
        when a request sends none (the k-th call issued, concurrent ones included), `max_tokens` caps each call's new
        tokens and is the budget of a call that sends none, `max_context` caps its prompt + completion;
        `top_k_logprobs` are recorded for every token whatever a request asks (exactly that many: a trajectory's
        rows must agree)."""
        url = self.session_url(session)
        if engine is None and self.engine is None:
            raise ValueError(f"session {session!r}: give an engine (this endpoint has none of its own)")
        with self._lock:
            if session in self._sessions:
                raise ValueError(f"session {session!r} is already open")
            self._closed.discard(session)
            self._sessions[session] = Session(engine, loop, temperature, seed, max_tokens, max_context,
                                              top_k_logprobs, opened=True)
        return url

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

    # --------------------------------------------------------------------------------------------- serving
    def start(self, timeout_s: float = 30.0) -> OpenAIEndpoint:
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="astratk-openai-endpoint", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"the OpenAI endpoint did not start on {self.host}:{self.port} within {timeout_s:g} s")
        if failure:
            raise RuntimeError(f"the OpenAI endpoint could not start on {self.host}:{self.port}: {failure[0]}")
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def _start_site(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        for prefix in ("/v1", "/s/{session}/v1"):
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the port the OS chose for port 0

    def close(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)

    def __enter__(self) -> OpenAIEndpoint:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- handlers
    def _error(self, e: RequestError) -> Any:
        from aiohttp import web

        self.stats["errors"] += 1
        return web.json_response(e.body(), status=e.status)

    def _authorised(self, request: Any) -> bool:
        if self.api_key is None:
            return True
        sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(sent, f"Bearer {self.api_key}".encode())

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        if not self._authorised(request):
            return self._error(RequestError(401, "invalid API key", code="invalid_api_key"))
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "astratk"}]})

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        self.stats["requests"] += 1
        if not self._authorised(request):
            return self._error(RequestError(401, "invalid API key: send Authorization: Bearer <api_key>",
                                            code="invalid_api_key"))
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge as e:
            return self._error(RequestError(413, f"the request body is too large: {e.text}"))
        except (ValueError, LookupError, RecursionError) as e:  # not JSON, a bad charset, nesting too deep
            return self._error(RequestError(400, f"the request body is not JSON: {type(e).__name__}: {e}"))
        session = request.match_info.get("session") or request.headers.get("X-Session-Id") or DEFAULT_SESSION
        try:
            if isinstance(body, dict) and body.get("model") not in (None, self.model):
                raise RequestError(404, f"the model {body.get('model')!r} does not exist; this endpoint serves "
                                   f"{self.model!r}", param="model", code="model_not_found")
            parsed = parse_request(body, self.default_max_tokens)
            sess = self._session(session)
            return web.json_response(await self._complete(parsed, session, sess))
        except RequestError as e:
            return self._error(e)
        except Exception as e:  # noqa: BLE001 - the server answers, whatever went wrong inside
            return self._error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    # --------------------------------------------------------------------------------------------- prompts
    def _chat_turns(self, tok: Any) -> Any:
        entry = self._turns_api.get(id(tok))
        if entry is None or entry[0] is not tok:
            entry = self._turns_api[id(tok)] = (tok, ChatTurns(tok))
        return entry[1]

    def _render(self, tok: Any, parsed: _Parsed) -> tuple[int, ...]:
        try:
            text = tok.apply_chat_template([_for_template(m) for m in parsed.messages], tools=parsed.tools,
                                           add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise RequestError(400, f"the model's chat template cannot render these messages: {e}",
                               param="messages") from None
        return tuple(tok(text, add_special_tokens=False)["input_ids"])

    def _prompt(self, sess: Session, tok: Any, parsed: _Parsed, tools: str) -> tuple[tuple[int, ...], _Turn | None]:
        """The prompt's ids and the earlier turn it extends (class docstring), or the template's rendering and None."""
        msgs = parsed.messages
        last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        turn = sess.turns.get(_turn_key(msgs[last])) if last is not None else None
        rest = msgs[last + 1:] if last is not None else []
        if (turn is not None and rest and turn.tools == tools and all(m["role"] != "assistant" for m in rest)
                and [_normalise(m) for m in msgs[:last]] == turn.history):
            try:
                text = self._chat_turns(tok).continuation_of(
                    [{"role": m["role"], "content": m.get("content") or ""} for m in rest],
                    _produced_close(tok, turn.completion))
            except Exception:  # noqa: BLE001 - no fixed turn separators, or a template that refuses the roles: the
                return self._render(tok, parsed), None  # whole conversation rendered (a 400 if it cannot be)
            ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
            return turn.prompt + tuple(turn.completion.token_ids) + ids, turn
        return self._render(tok, parsed), None

    async def _complete(self, parsed: _Parsed, session: str, sess: Session) -> dict[str, Any]:
        engine = sess.engine if sess.engine is not None else self.engine
        tok = engine.tokenizer
        tools = json.dumps(parsed.tools, sort_keys=True)
        prompt, extended = self._prompt(sess, tok, parsed, tools)
        self.stats["reused_turns" if extended is not None else "rendered_prompts"] += 1
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
        limits = [x for x in (self.max_model_len, sess.max_context, getattr(engine, "max_model_len", None)) if x]
        if limits:
            limit = int(min(limits))
            room = limit - len(prompt)
            if room < 1:
                raise RequestError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                   f"messages resulted in {len(prompt)} tokens.", param="messages",
                                   code="context_length_exceeded")
            if params.max_tokens > room:
                params = dataclasses.replace(params, max_tokens=room)
        params = dataclasses.replace(params, stop_token_ids=stop_token_ids(tok))
        started = time.time()
        work = engine.generate([GenerationRequest(prompt, params)])
        if sess.loop is not None and sess.loop is not asyncio.get_running_loop():
            if sess.loop.is_closed():
                raise RequestError(404, f"session {session!r} has ended (its event loop is closed)",
                                   code="session_closed")
            completions = tuple(await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, sess.loop)))
        else:
            completions = tuple(await work)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        captured = completions if not sess.opened else tuple(  # a training episode records exactly its K per token
            _top_k(c, sess.top_k_logprobs) for c in completions)
        call = CapturedCall(session, call_id, parsed.messages, parsed.tools, prompt, captured, started,
                            time.time() - started, extended.call_id if extended is not None else None,
                            extended.choice if extended is not None else 0)
        self._record(sess, call)
        choices = [_choice(tok, i, c, parsed) for i, c in enumerate(completions)]
        history = [_normalise(m) for m in parsed.messages]
        for i, (choice, c) in enumerate(zip(choices, captured)):
            sess.turns[_turn_key(choice["message"])] = _Turn(call_id, i, history, tools, prompt, c)
        while len(sess.turns) > MAX_TURNS:
            del sess.turns[next(iter(sess.turns))]
        used = sum(len(c.token_ids) for c in completions)
        self.stats["completion_tokens"] += used
        self.stats["prompt_tokens"] += len(prompt)
        return {"id": call_id, "object": "chat.completion", "created": int(started), "model": self.model,
                "choices": choices, "system_fingerprint": None,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": used,
                          "total_tokens": len(prompt) + used}}

