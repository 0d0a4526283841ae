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
each get their own `base_url` and their calls never mix.

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
import json
import math
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion, GenerationRequest, SamplingParams
from astratk.models.chat import stop_token_ids

MAX_N = 128
MAX_STOP = 4
DEFAULT_SESSION = "default"


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


@dataclass
class _Parsed:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: SamplingParams
    logprobs: bool
    top_logprobs: int
    parse_tools: bool
    extra: dict[str, Any] = field(default_factory=dict)


def _number(body: dict[str, Any], key: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi or (isinstance(value, float) and math.isnan(value)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{key}' must be {kind} in [{lo:g}, {hi:g}], got {value!r}", param=key)
    return value


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content):
                raise RequestError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
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
    messages = _check_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "'tools' must be a list of tool objects", param="tools")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else _number(
        {"max_tokens": max_tokens}, "max_tokens", None, 1, 1 << 20, integer=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings",
                           param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    logprobs = body.get("logprobs", False)
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
    return _Parsed(messages, tools or None, params, logprobs, top, parse_tools)


def _tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, OpenAI tool_calls) of a generation with Hermes/Qwen-style calls."""
    from astratk.models.chat import _TOOL_CALL, parse_tool_call

    calls = []
    for match in _TOOL_CALL.finditer(text):
        call = parse_tool_call(match.group(1))
        if call.error:
            continue  # a malformed call stays in the content, where the agent can see it
        args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call.name, "arguments": args}})
    if not calls:
        return text, []
    head = text[:text.index("<tool_call>")].strip()
    return (head or None), calls


class OpenAIEndpoint:
    """`/v1/models` and `/v1/chat/completions` over `engine` (module docstring). `start()` serves on a thread of its
    own; `close()` stops it."""

    def __init__(self, engine: Any, model: str = "astratk", *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_model_len: int | None = None, default_max_tokens: int = 256,
                 keep_calls: int = 100_000) -> None:
        self.engine = engine
        self.model = model
        self.host, self.port = host, port
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.keep_calls = keep_calls
        self._calls: dict[str, list[CapturedCall]] = defaultdict(list)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "errors": 0, "completion_tokens": 0, "prompt_tokens": 0}

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

    # --------------------------------------------------------------------------------------------- captured calls
    def calls(self, session: str = DEFAULT_SESSION) -> list[CapturedCall]:
        with self._lock:
            return list(self._calls.get(session, []))

    def pop_session(self, session: str) -> list[CapturedCall]:
        """The session's calls, forgotten here (an episode's trajectory is built once)."""
        with self._lock:
            return self._calls.pop(session, [])

    def _record(self, call: CapturedCall) -> None:
        with self._lock:
            self._calls[call.session].append(call)
            if sum(len(v) for v in self._calls.values()) > self.keep_calls:
                oldest = min(self._calls, key=lambda s: self._calls[s][0].started if self._calls[s] else math.inf)
                self._calls[oldest].pop(0)

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
        return self.api_key is None or request.headers.get("Authorization", "") == f"Bearer {self.api_key}"

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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self._error(RequestError(400, f"the request body is not JSON: {e}"))
        session = request.match_info.get("session") or request.headers.get("X-Session-Id") or DEFAULT_SESSION
        try:
            if isinstance(body, dict) and body.get("model") not in (None, self.model):
                raise RequestError(404, f"the model {body.get('model')!r} does not exist; this endpoint serves "
                                   f"{self.model!r}", param="model", code="model_not_found")
            parsed = parse_request(body, self.default_max_tokens)
            return web.json_response(await self._complete(parsed, session))
        except RequestError as e:
            return self._error(e)
        except Exception as e:  # noqa: BLE001 - the server answers, whatever went wrong inside
            return self._error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    async def _complete(self, parsed: _Parsed, session: str) -> dict[str, Any]:
        tok = self.engine.tokenizer
        try:
            text = tok.apply_chat_template(parsed.messages, tools=parsed.tools, add_generation_prompt=True,
                                           tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise RequestError(400, f"the model's chat template cannot render these messages: {e}",
                               param="messages") from None
        prompt = tuple(tok(text, add_special_tokens=False)["input_ids"])
        params = parsed.params
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise RequestError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                   f"However, your messages resulted in {len(prompt)} tokens.", param="messages",
                                   code="context_length_exceeded")
            if params.max_tokens > room:
                params = dataclasses.replace(params, max_tokens=room)
        params = dataclasses.replace(params, stop_token_ids=stop_token_ids(tok))
        started = time.time()
        completions = tuple(await self.engine.generate([GenerationRequest(prompt, params)]))
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._record(CapturedCall(session, call_id, parsed.messages, parsed.tools, prompt, completions, started,
                                  time.time() - started))
        choices = [self._choice(i, c, parsed) for i, c in enumerate(completions)]
        used = sum(len(c.token_ids) for c in completions)
        self.stats["completion_tokens"] += used
        self.stats["prompt_tokens"] += len(prompt)
        return {"id": call_id, "object": "chat.completion", "created": int(started), "model": self.model,
                "choices": choices, "system_fingerprint": None,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": used,
                          "total_tokens": len(prompt) + used}}

    def _choice(self, index: int, c: Completion, parsed: _Parsed) -> dict[str, Any]:
        tok = self.engine.tokenizer
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
