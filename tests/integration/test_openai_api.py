"""The OpenAI-compatible endpoint driven by the real `openai` client: a TorchEngine on the tiny model behind it, every
call captured in token space (the tokens and log-probs the client saw are the engine's), sessions kept apart, tool
calls parsed, and bad requests answered with OpenAI-style errors instead of crashing the server."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines.scripted import ScriptedEngine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.models.cache import ensure_model
from astratk.models.chat import stop_token_ids
from astratk.rollout.openai_api import OpenAIEndpoint
from astratk.spec import ModelSpec, TinyModelSpec

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from astratk.engines.torch_engine import TorchEngine

    tiny = TinyModelSpec(warm_start_steps=30, warm_start_batch=32, warm_start_target=None)
    path = ensure_model(ModelSpec(tiny=tiny), ArithmeticEnv(levels=[1]), cache_dir=tmp_path_factory.mktemp("cache"),
                        log=lambda s: None)
    eng = TorchEngine(str(path), version=3)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def endpoint(engine):
    with OpenAIEndpoint(engine, model="policy", max_model_len=256, default_max_tokens=8) as ep:
        yield ep


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_models_and_a_completion_captured_in_token_space(endpoint, engine):
    c = client(endpoint.session_url("ep-1"))
    assert [m.id for m in c.models.list().data] == ["policy"]
    reply = c.chat.completions.create(model="policy", messages=MESSAGES, n=3, temperature=1.0, max_tokens=6, seed=7,
                                      logprobs=True, top_logprobs=2)
    [call] = endpoint.calls("ep-1")
    tok = engine.tokenizer
    assert call.prompt_ids == tuple(tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                tokenize=False), add_special_tokens=False)["input_ids"])
    assert len(reply.choices) == len(call.completions) == 3
    assert reply.usage.prompt_tokens == len(call.prompt_ids)
    assert reply.usage.completion_tokens == sum(len(x.token_ids) for x in call.completions)
    for choice, done in zip(reply.choices, call.completions):
        assert choice.message.content == tok.decode(list(done.token_ids), skip_special_tokens=True)
        assert [e.logprob for e in choice.logprobs.content] == list(done.logprobs)
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        assert set(done.versions) == {3} and len(done.versions) == len(done.token_ids)
        assert choice.finish_reason in ("stop", "length")
    # what the engine itself samples for the same prompt and seed: the same tokens (nothing re-tokenised)
    direct = engine.submit([GenerationRequest(call.prompt_ids, SamplingParams(
        temperature=1.0, max_tokens=6, seed=7, n=3, top_k_logprobs=2, stop_token_ids=stop_token_ids(tok)))]).result(60)
    assert [d.token_ids for d in direct] == [x.token_ids for x in call.completions]
    assert endpoint.pop_session("ep-1") and endpoint.calls("ep-1") == []


def test_concurrent_sessions_do_not_mix(endpoint):
    def episode(i: int) -> str:
        c = client(endpoint.session_url(f"conc-{i}"))
        for _ in range(2):
            c.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"{i} + 1 ="}],
                                      max_tokens=4)
        return f"conc-{i}"

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        sessions = list(pool.map(episode, range(6)))
    for i, s in enumerate(sessions):
        calls = endpoint.calls(s)
        assert len(calls) == 2 and all(call.messages[0]["content"] == f"{i} + 1 =" for call in calls)


def test_bad_requests_get_openai_errors_and_the_server_stays_up(endpoint):
    c = client(endpoint.base_url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="policy", messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="policy", messages=MESSAGES, temperature=5)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 400}])
    assert e.value.code == "context_length_exceeded" and "256 tokens" in e.value.message
    request = urllib.request.Request(f"{endpoint.base_url}/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    assert http.value.code == 400 and "not JSON" in json.loads(http.value.read())["error"]["message"]
    assert c.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2).choices  # still serving


def test_api_key_is_required_when_set(engine):
    with OpenAIEndpoint(engine, model="policy", api_key="s3cret") as ep:
        with pytest.raises(openai.AuthenticationError):
            client(ep.base_url, "wrong").models.list()
        assert client(ep.base_url, "s3cret").models.list().data[0].id == "policy"


def test_tool_calls_in_the_generation_come_back_as_tool_calls(engine):
    tok = engine.tokenizer
    text = 'Let me look.<tool_call>{"name": "search", "arguments": {"q": "capital of France"}}</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"] + list(stop_token_ids(tok)[:1])
    scripted = ScriptedEngine(tok, lambda prompt, params: ids)
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    with OpenAIEndpoint(scripted, model="policy", default_max_tokens=len(ids) + 1) as ep:
        reply = client(ep.base_url).chat.completions.create(model="policy", messages=MESSAGES, tools=tools)
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        [call] = choice.message.tool_calls
        assert call.function.name == "search" and json.loads(call.function.arguments) == {"q": "capital of France"}
        plain = client(ep.base_url).chat.completions.create(model="policy", messages=MESSAGES)  # no tools asked
        assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content
