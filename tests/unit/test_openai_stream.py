"""`stream: true` on the OpenAI endpoint: Server-Sent Events as OpenAI sends them (role, content deltas with their
log-probs, tool-call deltas, finish_reason, usage when asked, [DONE]), read with the `openai` client and raw HTTP;
the joined deltas are the non-streaming answer, and the capture is the same token for token. A scripted engine stands
behind the endpoint (no model), requests go over real HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from astratk.engines.scripted import ScriptedEngine
from astratk.models.chat import stop_token_ids
from astratk.models.tokenizer import build_char_tokenizer
from astratk.rollout import openai_api
from astratk.rollout.openai_api import OpenAIEndpoint
from astratk.rollout.openai_stream import token_pieces

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

TOK = build_char_tokenizer()
END = stop_token_ids(TOK)[0]
ASK = [{"role": "user", "content": "what is 2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = 'I will add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def scripted(reply: str) -> ScriptedEngine:
    return ScriptedEngine(TOK, lambda prompt, params: ids(reply) + [END])


def stream(client, **kw) -> list:
    return list(client.chat.completions.create(model="m", stream=True, **kw))


def joined(chunks: list, index: int = 0) -> dict:
    """A streamed choice put together the way clients do it: content and each call's arguments concatenated."""
    content, calls, finish, lps = "", {}, None, []
    for c in chunks:
        for ch in c.choices:
            if ch.index != index:
                continue
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] = tc.function.name or slot["name"]
                    slot["arguments"] += tc.function.arguments or ""
            if ch.logprobs is not None and ch.logprobs.content:
                lps += [(e.token, e.logprob) for e in ch.logprobs.content]
            finish = ch.finish_reason or finish
    return {"content": content, "calls": [calls[k] for k in sorted(calls)], "finish": finish, "logprobs": lps}


def test_a_stream_joins_to_the_answer_and_captures_the_same_tokens():
    with OpenAIEndpoint(scripted("The sum is 5."), model="m", default_max_tokens=64) as ep:
        plain = openai.OpenAI(base_url=ep.session_url("a"), api_key="x").chat.completions.create(
            model="m", messages=ASK, seed=1, logprobs=True)
        chunks = stream(openai.OpenAI(base_url=ep.session_url("b"), api_key="x"), messages=ASK, seed=1,
                        logprobs=True, stream_options={"include_usage": True})
        [a], [b] = ep.calls("a"), ep.calls("b")
        stats = dict(ep.stats)
    got = joined(chunks)
    assert got["content"] == plain.choices[0].message.content == "The sum is 5."
    assert got["finish"] == plain.choices[0].finish_reason == "stop"
    assert got["logprobs"] == [(e.token, e.logprob) for e in plain.choices[0].logprobs.content]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 5  # token by token, not one lump
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {b.call_id} and all(c.object == "chat.completion.chunk" for c in chunks)
    # usage: null on every chunk but the last, which has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert a.prompt_ids == b.prompt_ids and a.completions == b.completions  # the capture, token for token
    assert stats["streamed"] == 1 and stats["errors"] == 0


def test_tool_call_deltas_and_the_streamed_turn_sent_back_is_reused_token_for_token():
    with OpenAIEndpoint(scripted(CALL), model="m", default_max_tokens=128) as ep:
        client = openai.OpenAI(base_url=ep.session_url("s"), api_key="x")
        chunks = stream(client, messages=ASK, tools=TOOLS)
        got = joined(chunks)
        assert got["finish"] == "tool_calls" and got["content"] == "I will add."
        [call] = got["calls"]
        assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 2, "b": 3}
        assert call["id"].startswith("call_")
        # the agent sends back what it put together from the deltas, with the tool's answer
        assistant = {"role": "assistant", "content": got["content"], "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}
        before = ep.stats["reused_turns"]
        stream(client, messages=[*ASK, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "5"}],
               tools=TOOLS)
        first, second = ep.calls("s")
        assert ep.stats["reused_turns"] == before + 1
    # the second prompt starts with the first prompt and the completion exactly as sampled
    sampled = first.prompt_ids + first.completions[0].token_ids
    assert second.prompt_ids[:len(sampled)] == sampled and second.extends == first.call_id


def test_n_choices_stream_side_by_side():
    with OpenAIEndpoint(scripted("ok"), model="m", default_max_tokens=8) as ep:
        chunks = stream(openai.OpenAI(base_url=ep.base_url, api_key="x"), messages=ASK, n=3)
    for i in range(3):
        assert joined(chunks, i) == {"content": "ok", "calls": [], "finish": "stop", "logprobs": []}


def _raw(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize(("extra", "message"), [
    ({"stream": "yes"}, "'stream' must be true or false"),
    ({"stream_options": {"include_usage": True}}, "only allowed when 'stream' is true"),
    ({"stream": True, "stream_options": {"include_usage": "x"}}, "'stream_options' must be an object"),
    ({"stream": True, "stream_options": [1]}, "'stream_options' must be an object"),
])
def test_bad_stream_fields_get_a_400(extra, message):
    with OpenAIEndpoint(scripted("ok"), model="m", default_max_tokens=8) as ep:
        status, text = _raw(ep.base_url, {"messages": ASK, **extra})
    assert status == 400 and message in json.loads(text)["error"]["message"], text


class Slow:
    """The scripted engine, `delay` seconds late; `fail` raises instead of answering."""

    def __init__(self, delay: float, fail: bool = False) -> None:
        self.inner, self.delay, self.fail = scripted("late"), delay, fail
        self.tokenizer, self.max_model_len = TOK, self.inner.max_model_len

    async def generate(self, requests):
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("the engine died")
        return await self.inner.generate(requests)


def test_a_slow_sample_keeps_the_stream_alive_and_a_late_error_is_an_sse_event(monkeypatch):
    monkeypatch.setattr(openai_api, "KEEPALIVE_S", 0.05)
    with OpenAIEndpoint(Slow(0.4), model="m", default_max_tokens=8) as ep:
        status, text = _raw(ep.base_url, {"messages": ASK, "stream": True})
    assert status == 200 and text.startswith(": keep-alive\n\n") and text.endswith("data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "late"
    with OpenAIEndpoint(Slow(0.4, fail=True), model="m", default_max_tokens=8) as ep:
        status, text = _raw(ep.base_url, {"messages": ASK, "stream": True})
        assert ep.stats["errors"] == 1
    assert status == 200 and "the engine died" in text and text.endswith("data: [DONE]\n\n")
    with OpenAIEndpoint(Slow(0.0, fail=True), model="m", default_max_tokens=8) as ep:  # before the stream: a 500
        status, text = _raw(ep.base_url, {"messages": ASK, "stream": True})
    assert status == 500 and "the engine died" in json.loads(text)["error"]["message"]


class ByteTokenizer:
    """Token = one UTF-8 byte: characters beyond ASCII span several tokens, whose prefixes do not decode whole."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld 🙂 ok", "🙂🙂🙂", "", "x" * 700 + "é" * 30])
def test_pieces_join_to_the_text_at_token_boundaries(text):
    tok = ByteTokenizer()
    data = list(text.encode())
    pieces = list(token_pieces(tok, data, text))
    assert "".join(p for p, _ in pieces) == text
    assert all("\ufffd" not in p for p, _ in pieces)
    spans = [s for _, s in pieces]  # every token rides in exactly one piece, in order
    assert [i for a, b in spans for i in range(a, b)] == list(range(len(data)))
    if text and len(data) <= 512:
        assert len(pieces) == len(text)  # one piece per character: as fine as the bytes allow
