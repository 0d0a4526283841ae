"""An OpenAI-compatible HTTP endpoint over one of astratk's engines, recording every call in token space.

Agents written against the OpenAI chat API (the `openai` client, LangGraph, smolagents...) talk to
`OpenAIEndpoint.base_url` as to any OpenAI server: `GET /v1/models` and `POST /v1/chat/completions` (`messages`,
`n`, `temperature`, `max_tokens` / `max_completion_tokens`, `stop`, `seed`, `logprobs` / `top_logprobs`, `tools`,
`stream` / `stream_options`: Server-Sent Events as OpenAI streams them, `astratk.rollout.openai_stream`).
The endpoint renders the messages with the model's own chat template, generates with the engine, and answers in
OpenAI's format, tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the generated text,
Hermes/Qwen style) as `tool_calls`. Tools go to the template where it renders them; where it drops them (SmolLM2's
and many others' templates have no tool section) they are written into the system message in the `hermes` format
that the parser reads back (`tool_format`, `astratk.models.tools`).

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

This module is the HTTP layer (the aiohttp server, its routes, the API key, error responses); the wire format
(request checks, choices) is `astratk.rollout.openai_format`, the session capture `astratk.rollout.openai_sessions`.

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
import hmac
import threading
from typing import Any

from astratk.rollout.openai_format import RequestError, parse_request
from astratk.rollout.openai_sessions import DEFAULT_SESSION, SessionCapture
from astratk.rollout.openai_stream import chunks, sse

KEEPALIVE_S = 5.0  # a stream whose sample is not ready sends an SSE comment this often
# OpenAI routes agents may call that this endpoint does not serve: a 404 whose one line says what to use instead
UNSERVED = {
    "responses": "the Responses API (/v1/responses) is not served here, only Chat Completions "
                 "(/v1/chat/completions): with the OpenAI Agents SDK use OpenAIChatCompletionsModel(model, "
                 "openai_client) or set_default_openai_api('chat_completions'); with langchain-openai leave "
                 "use_responses_api unset",
    "completions": "the legacy Completions API (/v1/completions, a raw prompt string) is not served here: a training "
                   "episode's prompts are rendered by the model's chat template; send chat messages to "
                   "/v1/chat/completions",
    "embeddings": "embeddings (/v1/embeddings) are not served here: this endpoint samples the policy being trained "
                  "(/v1/chat/completions); embed with a model of your own",
}


class OpenAIEndpoint(SessionCapture):
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
                 keep_calls: int = 100_000, max_sessions: int = 10_000, max_inflight: int = 1024,
                 tool_format: str = "auto") -> None:
        super().__init__(engine, model, max_model_len=max_model_len, default_max_tokens=default_max_tokens,
                         keep_calls=keep_calls, max_sessions=max_sessions, tool_format=tool_format)
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.host, self.port = host, port
        self.api_key = api_key
        self.max_inflight = max_inflight  # completions held at once; more are shed with a 429 (clients retry)
        self.inflight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._thread: threading.Thread | None = None

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
                     max_context: int | None = None, top_k_logprobs: int = 0, tool_format: str | None = None) -> str:
        """Serve `session` with `engine` (default: the endpoint's) on `loop`; returns its base URL. `temperature`
        overrides what requests ask for (counted in `session_stats`), `seed` seeds the k-th call with seed + 7919·k
        when a request sends none (the k-th call issued, concurrent ones included), `max_tokens` caps each call's new
        tokens and is the budget of a call that sends none, `max_context` caps its prompt + completion;
        `top_k_logprobs` are recorded for every token whatever a request asks (exactly that many: a trajectory's
        rows must agree); `tool_format` is how the session's tools reach the model (None: the endpoint's;
        `astratk.models.tools`)."""
        url = self.session_url(session)
        self.register_session(session, engine, loop=loop, temperature=temperature, seed=seed, max_tokens=max_tokens,
                              max_context=max_context, top_k_logprobs=top_k_logprobs, tool_format=tool_format)
        return url

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
            for route in UNSERVED:
                app.router.add_route("*", f"{prefix}/{route}", self._unserved)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # backlog: a burst of connections waits in the kernel's queue instead of being refused (default 128)
        await web.TCPSite(self._runner, self.host, self.port, backlog=4096).start()
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

    async def _unserved(self, request: Any) -> Any:
        route = request.path.rsplit("/v1/", 1)[1]
        self.stats["unserved"] += 1
        return self._error(RequestError(404, UNSERVED[route], code="unsupported_route"))

    async def _chat(self, request: Any) -> Any:
        self.stats["requests"] += 1
        if self.inflight >= self.max_inflight:  # shed before reading the body: a flood costs no memory
            self.stats["shed"] += 1
            response = self._error(RequestError(429, f"the endpoint holds {self.inflight} requests, its max_inflight; "
                                                "retry shortly", kind="rate_limit_error", code="rate_limit_exceeded"))
            response.headers["Retry-After"] = "1"
            return response
        self.inflight += 1
        self.stats["max_inflight_seen"] = max(self.stats["max_inflight_seen"], self.inflight)
        try:
            return await self._chat_held(request)
        finally:
            self.inflight -= 1

    async def _chat_held(self, request: Any) -> Any:
        from aiohttp import web

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
            if parsed.stream:
                return await self._stream(request, parsed, session, sess)
            answer, _ = await self._complete(parsed, session, sess)
            return web.json_response(answer)
        except RequestError as e:
            return self._error(e)
        except Exception as e:  # noqa: BLE001 - the server answers, whatever went wrong inside
            return self._error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    async def _stream(self, request: Any, parsed: Any, session: str, sess: Any) -> Any:
        """`stream: true` (astratk.rollout.openai_stream): sample and record as without streaming, then send the
        answer as chunks. A refusal that comes within KEEPALIVE_S is a plain error response; after that the stream
        has begun, keep-alive comments flow while the engine samples, and an error is an SSE error event."""
        from aiohttp import web

        task = asyncio.ensure_future(self._complete(parsed, session, sess))
        await asyncio.wait({task}, timeout=KEEPALIVE_S)
        if task.done() and task.exception() is not None:
            raise task.exception()  # answered as a status code by _chat
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        try:
            await response.prepare(request)
            while not task.done():
                await response.write(b": keep-alive\n\n")
                await asyncio.wait({task}, timeout=KEEPALIVE_S)
            try:
                answer, completions = task.result()
            except Exception as e:  # noqa: BLE001 - sent to the client, which has a 200 already
                error = e if isinstance(e, RequestError) else RequestError(500, f"{type(e).__name__}: {e}",
                                                                           kind="server_error")
                self.stats["errors"] += 1
                await response.write(sse(error.body()))
            else:
                tok = (sess.engine if sess.engine is not None else self.engine).tokenizer
                for chunk in chunks(answer, completions, tok, parsed.include_usage, parsed.logprobs):
                    await response.write(sse(chunk))
                self.stats["streamed"] += 1
            await response.write(sse("[DONE]"))
            await response.write_eof()
        except ConnectionError:  # the client left mid-stream: its call is recorded all the same
            self.stats["stream_disconnects"] += 1
        return response
