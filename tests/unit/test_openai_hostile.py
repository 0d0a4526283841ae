"""The OpenAI-compatible endpoint against hostile and unusual clients: every malformed request gets an OpenAI-style
JSON error with a 4xx status (never a 500, never a dead server), and a session's sampling rules hold for concurrent
calls, calls that leave fields out, and calls that ask for other top-log-prob widths than the run records.
A scripted engine stands behind the endpoint (no model), requests go over real HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest

from astratk.contracts import Completion
from astratk.engines.scripted import ScriptedEngine
from astratk.models.chat import stop_token_ids
from astratk.models.tokenizer import build_char_tokenizer
from astratk.rollout.openai_api import OpenAIEndpoint

pytest.importorskip("aiohttp")

TOK = build_char_tokenizer()
END = stop_token_ids(TOK)[0]
ASK = [{"role": "user", "content": "hi"}]


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/chat/completions", data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def endpoint():
    engine = ScriptedEngine(TOK, lambda prompt, params: TOK("ok", add_special_tokens=False)["input_ids"] + [END])
    with OpenAIEndpoint(engine, model="m", default_max_tokens=8, max_sessions=50) as ep:
        yield ep


HOSTILE = {
    "content part whose text is not a string": {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                           "text": 5}]}]},
    "an image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "tool_calls not a list": {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": 5}]},
    "tool call id not a string": {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": ["a"], "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
    "tool call without a function": {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
    "tool_call_id not a string": {"messages": [*ASK, {"role": "tool", "content": "x", "tool_call_id": 3}]},
    "a lone surrogate": {"messages": [{"role": "user", "content": "\ud800"}]},
    "messages not a list": {"messages": "hi"},
    "a message without a role": {"messages": [{"content": "hi"}]},
    "a role OpenAI does not know": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content a number": {"messages": [{"role": "user", "content": 3}]},
    "the body a list": [1, 2],
    "n zero": {"messages": ASK, "n": 0},
    "n huge": {"messages": ASK, "n": 10**9},
    "temperature NaN-like string": {"messages": ASK, "temperature": "hot"},
    "temperature negative": {"messages": ASK, "temperature": -1},
    "max_tokens a bool": {"messages": ASK, "max_tokens": True},
    "max_tokens zero": {"messages": ASK, "max_tokens": 0},
    "stop a number": {"messages": ASK, "stop": 3},
    "too many stops": {"messages": ASK, "stop": ["a", "b", "c", "d", "e"]},
    "seed beyond 64 bits": {"messages": ASK, "seed": 1 << 70},
    "seed a float": {"messages": ASK, "seed": 1.5},
    "logprobs a string": {"messages": ASK, "logprobs": "yes"},
    "top_logprobs without logprobs": {"messages": ASK, "top_logprobs": 3},
    "top_logprobs out of range": {"messages": ASK, "logprobs": True, "top_logprobs": 99},
    "tools not a list": {"messages": ASK, "tools": {"a": 1}},
    "stream not a boolean": {"messages": ASK, "stream": "yes"},
    "stream_options without stream": {"messages": ASK, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_malformed_requests_get_a_4xx_openai_error(endpoint, what):
    body = HOSTILE[what]
    data = json.dumps(body, ensure_ascii=what != "a lone surrogate").encode("utf-8", "surrogatepass")
    status, reply = post(endpoint.base_url, data)
    assert 400 <= status < 500, (status, reply)
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["message"]
    assert post(endpoint.base_url, {"messages": ASK})[0] == 200  # the server still answers


@pytest.mark.parametrize(("data", "headers"), [
    (b"{not json", {}),
    (b"[" * 200_000, {}),  # nested past the JSON parser's recursion limit
    (b'{"messages": []}', {"Content-Type": "application/json; charset=bogus"}),
    (b"\xff\xfe", {}),
])
def test_bodies_that_are_not_json_get_a_400(endpoint, data, headers):
    status, reply = post(endpoint.base_url, data, headers)
    assert status == 400 and "not JSON" in reply["error"]["message"]


@pytest.mark.slow  # seconds: left out of the fast tier
def test_a_body_over_the_size_cap_gets_a_json_413():
    engine = ScriptedEngine(TOK, lambda prompt, params: [END])
    with OpenAIEndpoint(engine, model="m") as ep:
        status, reply = post(ep.base_url, b'{"messages": "' + b"x" * (100 << 20) + b'"}')  # 100 MB
        assert post(ep.base_url, {"messages": ASK})[0] == 200  # and the server is still up
    assert status == 413 and reply["error"]["message"]


def test_null_optional_fields_are_the_defaults(endpoint):
    status, reply = post(endpoint.base_url, {"messages": ASK, "logprobs": None, "max_completion_tokens": None,
                                             "max_tokens": 2, "temperature": None, "seed": None, "stop": None})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_the_api_key_is_checked_on_completions_too():
    engine = ScriptedEngine(TOK, lambda prompt, params: [END])
    with OpenAIEndpoint(engine, model="m", api_key="s3cret") as ep:
        assert post(ep.base_url, {"messages": ASK})[0] == 401
        assert post(ep.base_url, {"messages": ASK}, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(ep.base_url, {"messages": ASK}, {"Authorization": "Bearer s3cret"})[0] == 200


def test_invented_session_paths_are_bounded_and_ended_sessions_refused(endpoint):
    for i in range(60):
        status, reply = post(endpoint.session_url(f"made-up-{i}"), {"messages": ASK})
        if status != 200:
            break
    assert status == 429 and reply["error"]["code"] == "too_many_sessions"
    for i in range(60):
        endpoint.close_session(f"made-up-{i}")
    assert post(endpoint.session_url("made-up-1"), {"messages": ASK})[0] == 404  # ended: refused, not reopened
    assert post(endpoint.session_url("fresh"), {"messages": ASK})[0] == 200


class GatedEngine:
    """Holds every call until `width` calls wait, then answers them all: calls that are truly concurrent."""

    def __init__(self, width: int) -> None:
        self.inner = ScriptedEngine(TOK, lambda prompt, params: [END])
        self.width, self.waiting, self.event = width, 0, None

    @property
    def tokenizer(self):
        return TOK

    @property
    def version(self):
        return 0

    async def generate(self, requests):
        self.event = self.event or asyncio.Event()
        self.waiting += 1
        if self.waiting >= self.width:
            self.event.set()
        await asyncio.wait_for(self.event.wait(), 20)
        return await self.inner.generate(requests)


def test_concurrent_calls_of_a_session_get_different_seeds():
    engine = GatedEngine(3)
    with OpenAIEndpoint(model="m") as ep:
        url = ep.open_session("episode", engine, seed=11)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(lambda _: post(url, {"messages": ASK})[0], range(3)))
        assert statuses == [200] * 3
        assert sorted(r.params.seed for r in engine.inner.requests) == [11, 11 + 7919, 11 + 2 * 7919]


def test_a_call_that_sends_no_budget_or_temperature_takes_the_runs_without_an_override():
    engine = ScriptedEngine(TOK, lambda prompt, params: [7] * 1000)
    with OpenAIEndpoint(model="m", default_max_tokens=4) as ep:
        url = ep.open_session("episode", engine, temperature=0.7, max_tokens=40)
        assert post(url, {"messages": ASK})[1]["usage"]["completion_tokens"] == 40  # the run's budget, not 4
        assert ep.session_stats("episode") == {}
        post(url, {"messages": ASK, "temperature": 1.0, "max_tokens": 100})
        assert ep.session_stats("episode") == {"temperature": 1, "max_tokens": 1}
        assert [r.params.temperature for r in engine.requests] == [0.7, 0.7]


class TopKEngine(ScriptedEngine):
    """Scripted, with the requested number of alternatives per token."""

    async def generate(self, requests):
        out = await super().generate(requests)
        return [Completion(c.token_ids, c.logprobs, c.versions, c.finish_reason,
                           topk_ids=tuple(tuple(range(r.params.top_k_logprobs)) for _ in c.token_ids),
                           topk_logprobs=tuple((-1.0,) * r.params.top_k_logprobs for _ in c.token_ids))
                for r, c in zip(requests, out)]


@pytest.mark.parametrize("run_k", [0, 2])
def test_a_training_session_records_exactly_the_runs_top_k(run_k):
    engine = TopKEngine(TOK, lambda prompt, params: [7, 8, END])
    with OpenAIEndpoint(model="m") as ep:
        url = ep.open_session("episode", engine, top_k_logprobs=run_k)
        for asked in (5, 1, 0):
            body = {"messages": ASK, **({"logprobs": True, "top_logprobs": asked} if asked else {})}
            status, reply = post(url, body)
            assert status == 200
            if asked:  # the client gets what it asked for ...
                assert len(reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == asked
        calls = ep.close_session("episode")
    for call in calls:  # ... the trajectory records the run's width, whatever each call asked
        assert {len(row) for row in call.completions[0].topk_ids} <= {run_k}


@pytest.mark.parametrize(("field", "value"), [("n", 10**9), ("n", 0), ("n", -1), ("max_tokens", 10**12),
                                              ("max_tokens", 0), ("max_completion_tokens", -5), ("n", 2.5)])
def test_absurd_n_and_max_tokens_get_a_400_naming_the_field(endpoint, field, value):
    status, reply = post(endpoint.base_url, {"messages": ASK, field: value})
    assert status == 400 and reply["error"]["param"] in (field, "max_tokens"), reply


def test_a_huge_but_legal_max_tokens_is_fitted_to_the_context():
    engine = ScriptedEngine(TOK, lambda prompt, params: TOK("x" * 500, add_special_tokens=False)["input_ids"],
                            max_model_len=128)
    with OpenAIEndpoint(engine, model="m") as ep:
        status, reply = post(ep.base_url, {"messages": ASK, "max_tokens": 1 << 20})
        [call] = ep.calls()
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert len(call.prompt_ids) + reply["usage"]["completion_tokens"] == 128


def test_a_flood_of_500_requests_is_held_or_shed_and_no_session_mixes():
    """bench/endpoint_load.py's check, small: 500 concurrent requests over 50 sessions (half streamed, ten clients
    hanging up mid-stream), first with room for all, then with max_inflight 100."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.endpoint_load import main

    roomy, capped = main(["--requests", "500", "--gen-ms", "50", "--caps", "1024,100"])
    for row in (roomy, capped):
        assert row["problems"] == [], row
        assert set(row["statuses"]) <= {"200", "429", "hung_up"}, row["statuses"]
    assert roomy["shed_429"] == 0 and roomy["held_at_once"] > 100 and roomy["recorded_calls"] == 500
    assert capped["held_at_once"] == 100 and capped["shed_429"] == capped["statuses"].get("429", 0) > 0
    assert capped["recorded_calls"] == 500 - capped["shed_429"]  # every request let in is recorded


def test_a_client_that_hangs_up_mid_stream_loses_nothing_and_the_server_stays_up(monkeypatch):
    import socket
    import time

    from astratk.rollout import openai_api

    monkeypatch.setattr(openai_api, "KEEPALIVE_S", 0.05)

    class Slow:
        def __init__(self) -> None:
            self.inner = ScriptedEngine(TOK, lambda prompt, params: TOK("ok", add_special_tokens=False)["input_ids"]
                                        + [END])
            self.tokenizer, self.max_model_len = TOK, None

        async def generate(self, requests):
            await asyncio.sleep(0.5)
            return await self.inner.generate(requests)

    with OpenAIEndpoint(Slow(), model="m") as ep:
        body = json.dumps({"messages": ASK, "stream": True}).encode()
        with socket.create_connection((ep.host, ep.port), timeout=10) as sock:
            sock.sendall(b"POST /s/gone/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert b"200" in sock.recv(200)  # the stream began (keep-alive comments), then the client leaves
        deadline = time.monotonic() + 10
        while (not ep.calls("gone") or not ep.stats["stream_disconnects"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ep.stats["stream_disconnects"] == 1
        [call] = ep.calls("gone")  # its sample was recorded all the same, in its own session
        assert call.completions[0].finish_reason == "stop"
        assert post(ep.base_url, {"messages": ASK})[0] == 200


@pytest.mark.parametrize(("route", "says"), [("responses", "set_default_openai_api('chat_completions')"),
                                             ("completions", "legacy Completions API"),
                                             ("embeddings", "not served here")])
def test_routes_it_does_not_serve_say_what_to_use_in_one_line(endpoint, route, says):
    for base in (endpoint.base_url, endpoint.session_url("x")):
        request = urllib.request.Request(f"{base}/{route}", data=b'{"model": "m", "input": "hi"}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(e.value.read())["error"]
        assert e.value.code == 404 and says in error["message"] and "\n" not in error["message"]
        assert error["code"] == "unsupported_route"
