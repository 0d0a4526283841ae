"""TorchEngine: behaviour log-probs equal the trainer's recomputation, greedy equals HF generate, stops (token ids and
strings), seeds, request batching across tasks and threads, weight loads (full and sparse deltas) between batches,
errors reaching their callers.

The engine always serves a deep copy of the reference model: it switches its own model's attention to a grouped-K/V
variant, so comparing against the untouched model also checks that variant against HF's stock sdpa.
"""

from __future__ import annotations

import asyncio
import copy
import string
import threading
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import Engine, GenerationRequest, SamplingParams
from astratk.engines import TorchEngine, build_engine
from astratk.engines.torch_sampling import _mix64, _sample, _text_stop_hits, _TextStops
from astratk.models import build_char_tokenizer
from astratk.training.logprobs import token_logprobs
from astratk.weights import make_delta

VOCAB = 64
PROMPT_LENGTHS = (3, 9, 5, 14)


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
                         max_position_embeddings=256,
                         initializer_range=0.1)  # HF's 0.02 gives a near-context-free model: greedy repeats one token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_model(0)


@pytest.fixture(scope="module")
def prompts() -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(1, VOCAB, (n,), generator=g).tolist()) for n in PROMPT_LENGTHS]


@pytest.fixture
def engine(model):
    eng = TorchEngine.from_model(copy.deepcopy(model), None, batch_window_s=0.01)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """VOCAB ids, each decoding to a fixed piece of 1 or 2 characters, concatenated: stop strings can span tokens
    and end inside one."""
    pieces = [*string.ascii_lowercase, *(c * 2 for c in string.ascii_lowercase),
              " ", ".", "th", "he", "in", "er", "an", "é", "<s>", "\n", "ab", "ba"]
    assert len(set(pieces)) == VOCAB
    core = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<s>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.fixture
def text_engine(model, tokenizer):
    eng = TorchEngine.from_model(copy.deepcopy(model), tokenizer, batch_window_s=0.01)
    yield eng
    eng.close()


def gen(engine, requests, timeout_s: float = 60.0):
    """Run one generate call; a hung engine fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(engine.generate(requests), timeout_s))


def req(prompt, **params) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(**params))


def right_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


# ---------------------------------------------------------------------------------------- (a) log-prob agreement


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behavior_logprobs_equal_trainer_recomputation(engine, model, prompts, temperature):
    requests = [req(p, temperature=temperature, max_tokens=12, seed=i) for i, p in enumerate(prompts)]
    completions = gen(engine, requests)
    ids, mask = right_padded([list(r.prompt_ids) + list(c.token_ids) for r, c in zip(requests, completions)])
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature)  # [B, T]: position t predicts ids[:, t+1]
    assert lp.dtype == torch.float32
    for i, (r, c) in enumerate(zip(requests, completions)):
        start = len(r.prompt_ids) - 1
        expected = lp[i, start:start + len(c.token_ids)]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
        assert all(v < 0 for v in c.logprobs)


def test_temperature_changes_logprobs(engine, prompts):
    """Guards the test above: log-probs at T=0.7 must differ from untempered ones on the same tokens."""
    [c] = gen(engine, [req(prompts[1], temperature=0.7, max_tokens=6, seed=3)])
    ids, mask = right_padded([list(prompts[1]) + list(c.token_ids)])
    with torch.no_grad():
        untempered = token_logprobs(engine._model, ids, mask, 1.0)[0, len(prompts[1]) - 1:]
    assert (untempered - torch.tensor(c.logprobs)).abs().max() > 1e-2


def test_token_logprobs_padding_and_alignment(model, prompts):
    seqs = [list(p) for p in prompts]
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, 1.0)
        alone = token_logprobs(model, ids[:1, :len(seqs[0])], mask[:1, :len(seqs[0])], 1.0)
        logits = model(ids[:1, :len(seqs[0])]).logits[0].float()
    assert lp.shape == (len(seqs), ids.shape[1] - 1)
    assert (lp[0, len(seqs[0]) - 1:] == 0).all()  # targets beyond the sequence are padding
    torch.testing.assert_close(lp[0, :len(seqs[0]) - 1], alone[0], atol=1e-5, rtol=0)
    # golden: log-prob of token 1 given token 0 is log_softmax(logits at position 0)[token 1]
    assert lp[0, 0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[seqs[0][1]].item(), abs=1e-5)


# ------------------------------------------------------------------------------------------ (b) greedy = HF generate


def test_greedy_matches_hf_generate(engine, model, prompts):
    completions = gen(engine, [req(p, temperature=0.0, max_tokens=10) for p in prompts])
    for p, c in zip(prompts, completions):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
        assert list(c.token_ids) == out[0, len(p):].tolist()
        assert c.finish_reason == "length" and len(c.token_ids) == 10


# ------------------------------------------------------------------------------------------------ (c) stop, budget


def test_stops_budgets_and_finish_reasons(engine, prompts):
    [greedy] = gen(engine, [req(prompts[0], temperature=0.0, max_tokens=12)])
    stop = greedy.token_ids[3]
    cut = greedy.token_ids.index(stop) + 1
    absent = next(t for t in range(VOCAB) if t not in greedy.token_ids)
    requests = [  # rows that finish first come first, so compaction moves the survivors
        req(prompts[3], temperature=1.0, max_tokens=12, stop_token_ids=tuple(range(VOCAB))),  # any token stops
        req(prompts[1], temperature=0.7, max_tokens=1, seed=1),
        req(prompts[2], temperature=1.0, max_tokens=5, seed=0),  # budget of 5
        req(prompts[0], temperature=0.0, max_tokens=12, stop_token_ids=(stop,)),  # stops at its first `stop`
        req(prompts[0], temperature=0.0, max_tokens=12, stop_token_ids=(absent,)),  # never stops
    ]
    c = gen(engine, requests)
    assert len(c[0].token_ids) == 1 and c[0].finish_reason == "stop"
    assert len(c[1].token_ids) == 1 and c[1].finish_reason == "length"
    assert len(c[2].token_ids) == 5 and c[2].finish_reason == "length"
    assert c[3].token_ids == greedy.token_ids[:cut] and c[3].token_ids[-1] == stop and c[3].finish_reason == "stop"
    # the row that ran on after the others finished (and were compacted away) is unchanged
    assert c[4].token_ids == greedy.token_ids and c[4].finish_reason == "length"
    for x in c:
        assert len(x.token_ids) == len(x.logprobs) == len(x.versions)


def completing_cut(tokenizer, tokens: tuple[int, ...], stop: str) -> int:
    """The expected length of a completion with stop string `stop`: up to the first token whose decoded text (of the
    generated tokens only) contains it."""
    return next(j + 1 for j in range(len(tokens)) if stop in tokenizer.decode(tokens[:j + 1]))


def test_stop_string_ends_at_the_token_completing_it(text_engine, tokenizer, prompts):
    [greedy] = gen(text_engine, [req(prompts[1], temperature=0.0, max_tokens=16)])
    ends = [len(tokenizer.decode(greedy.token_ids[:j + 1])) for j in range(16)]  # text length after each token
    text = tokenizer.decode(greedy.token_ids)
    stop = text[ends[3] - 1:ends[6] - 1]  # from token 4's last character to just before token 7's last one
    cut = completing_cut(tokenizer, greedy.token_ids, stop)
    assert 1 < cut < 16, (text, stop)  # the test stops mid-completion
    [c] = gen(text_engine, [req(prompts[1], temperature=0.0, max_tokens=16, stop=(stop, "never"))])
    assert c.token_ids == greedy.token_ids[:cut] and c.finish_reason == "stop"
    assert c.logprobs == greedy.logprobs[:cut] and len(c.versions) == cut
    # the prompt is not searched: a string of the prompt's text that the completion lacks stops nothing
    prompt_text = tokenizer.decode(prompts[1])
    in_prompt = next(prompt_text[i:i + 2] for i in range(len(prompt_text) - 1) if prompt_text[i:i + 2] not in text)
    [same] = gen(text_engine, [req(prompts[1], temperature=0.0, max_tokens=16, stop=(in_prompt, "zzzzzzzzz"))])
    assert same.token_ids == greedy.token_ids and same.finish_reason == "length"


def test_stop_strings_in_a_mixed_batch(text_engine, tokenizer, prompts):
    """Rows with and without stop strings share a batch; rows finishing first are compacted away, so the stop-string
    rows move and their text state must follow them. Seeded sampled rows are batch-independent, so each stopped row
    is a prefix of the same request run alone without stops."""
    free = [req(p, temperature=1.0, max_tokens=14, seed=i) for i, p in enumerate(prompts)]
    alone = [gen(text_engine, [r])[0] for r in free]
    texts = [tokenizer.decode(c.token_ids) for c in alone]
    stops = [texts[2][7:9], texts[3][10:13]]  # two or three characters late in rows 2 and 3
    cuts = [completing_cut(tokenizer, alone[2].token_ids, stops[0]),
            completing_cut(tokenizer, alone[3].token_ids, stops[1])]
    requests = [
        req(prompts[0], temperature=1.0, max_tokens=1, seed=10),  # finishes first: compaction moves the rest
        req(prompts[1], temperature=1.0, max_tokens=2, seed=11),
        req(prompts[2], temperature=1.0, max_tokens=14, seed=2, stop=(stops[0],)),
        free[0],
        req(prompts[3], temperature=1.0, max_tokens=14, seed=3, stop=("zzzzz", stops[1]), stop_token_ids=(VOCAB,)),
        req(prompts[1], temperature=1.0, max_tokens=14, seed=1, stop=("zzzzz",)),  # never appears: unchanged
    ]
    c = gen(text_engine, requests)
    assert [len(x.token_ids) for x in c[:2]] == [1, 2]
    assert c[2].token_ids == alone[2].token_ids[:cuts[0]] and c[2].finish_reason == "stop"
    assert c[3].token_ids == alone[0].token_ids and c[3].finish_reason == "length"
    assert c[4].token_ids == alone[3].token_ids[:cuts[1]] and c[4].finish_reason == "stop"
    assert c[5].token_ids == alone[1].token_ids and c[5].finish_reason == "length"


def test_stop_strings_need_a_tokenizer(engine, prompts):
    with pytest.raises(ValueError, match="need an engine with a tokenizer"):
        engine.submit([req(prompts[0], stop=("x",))])
    assert engine.stats["requests"] == 0


def test_stop_string_check_with_multibyte_characters_and_a_sliding_tail():
    """Byte tokens: 'é' takes two, so a stop string completes on its second byte. A long text slides the decoded
    tail; each occurrence is found exactly once, at the token that completes it."""
    tok = build_char_tokenizer()
    text = "x" * 40 + "un café, " + "y" * 50 + "deux cafés et un thé"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte
    for stop in ("café", "é", "s e"):
        states = {7: _TextStops((stop, "never"))}
        hits = [bool(_text_stop_hits(tok, states, torch.tensor([7]), torch.tensor([t]), torch.tensor([True]))[0])
                for t in ids]
        counts = [tok.decode(ids[:j + 1]).count(stop) for j in range(len(ids))]
        expected = [j for j in range(len(ids)) if counts[j] > (counts[j - 1] if j else 0)]
        assert [j for j, h in enumerate(hits) if h] == expected and expected, stop


# ---------------------------------------------------------------------------------------------------- (d) seeds


def test_seed_reproducible_whatever_the_batch(engine, model, prompts):
    target = req(prompts[1], temperature=1.0, max_tokens=16, seed=7)
    [alone] = gen(engine, [target])
    others = [req(p, temperature=t, max_tokens=20) for p in prompts for t in (1.0, 0.5)]
    batched = gen(engine, others[:3] + [target] + others[3:])[3]
    assert batched.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    [other_seed] = gen(engine, [req(prompts[1], temperature=1.0, max_tokens=16, seed=8)])
    assert other_seed.token_ids != alone.token_ids
    # unseeded rows follow the engine's generator: two engines with the same seed agree
    with TorchEngine.from_model(copy.deepcopy(model), seed=5) as a, TorchEngine.from_model(copy.deepcopy(model),
                                                                                            seed=5) as b:
        unseeded = [req(p, max_tokens=8) for p in prompts]
        assert [c.token_ids for c in gen(a, unseeded)] == [c.token_ids for c in gen(b, unseeded)]


def test_a_groups_shared_prompt_is_prefilled_once_with_the_same_results(engine, prompts):
    """Equal prompts in a batch (a group's samples) share one prefill; each seeded sample still gets the tokens and
    log-probs it gets alone, next to rows with other prompts and temperatures."""
    group = [req(prompts[2], temperature=1.0, max_tokens=12, seed=40 + j) for j in range(5)]
    others = [req(prompts[0], temperature=0.7, max_tokens=6, seed=3), req(prompts[1], temperature=0.0, max_tokens=9)]
    batched = gen(engine, [others[0], *group[:3], others[1], *group[3:]])
    assert len({c.token_ids for c in batched[1:4]}) == 3  # different samples of the shared prompt
    for got, request in zip(batched, [others[0], *group[:3], others[1], *group[3:]]):
        [alone] = gen(engine, [request])
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_a_prefix_every_prompt_shares_is_prefilled_once_with_the_same_results(engine, model):
    """An agent's turns share a long prefix (system message, tools): it is prefilled once and copied to every row;
    each request still gets the tokens and log-probs it gets alone, whatever the lengths of the rest, and a request
    whose prompt is the prefix itself plus one token is fine (every row keeps a token of its own)."""
    from astratk.engines.torch_decode import MIN_SHARED_PREFIX, shared_prefix

    g = torch.Generator().manual_seed(3)
    head = tuple(torch.randint(4, 60, (MIN_SHARED_PREFIX + 8,), generator=g).tolist())
    tails = [(7,), (9, 11, 13, 15, 17), (21, 22, 23), (7, 8), (50,) * 9]
    requests = [req(head + t, temperature=1.0, max_tokens=10, seed=60 + i) for i, t in enumerate(tails)]
    requests.append(req(head + tails[1], temperature=0.0, max_tokens=6))  # a shared prompt too
    assert shared_prefix([r.prompt_ids for r in requests]) == len(head)
    assert shared_prefix([head + (1,), head[:5] + (2,)]) == 0  # too short to be worth it
    batched = gen(engine, requests)
    for got, request in zip(batched, requests):
        [alone] = gen(engine, [request])
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_a_turn_that_extends_an_earlier_sequence_starts_from_its_cache_with_the_same_results(model):
    """The prefix cache: an agent's next turn (its prompt, the reply, a few new tokens) prefills only the new tokens;
    a new episode reuses the common prefix (system message and tools) of any earlier sequence; a batch mixes rows with
    and without a reused prefix; each request gets the tokens and log-probs an engine without the cache gives it, and
    a weight load forgets every entry."""
    g = torch.Generator().manual_seed(9)
    head = tuple(torch.randint(4, 60, (40,), generator=g).tolist())
    firsts = [req(head + t, temperature=1.0, max_tokens=12, seed=70 + i, stop_token_ids=(3,))
              for i, t in enumerate([(5, 6), (7,), (8, 9, 10, 11)])]
    with TorchEngine.from_model(copy.deepcopy(model), batch_window_s=0.01) as cached, \
            TorchEngine.from_model(copy.deepcopy(model), enable_prefix_caching=False) as plain:
        assert "prefix_hits" not in plain.stats
        turn1 = gen(cached, firsts)
        assert [c.token_ids for c in turn1] == [c.token_ids for c in gen(plain, firsts)]
        assert cached.stats["prefix_hits"] == 0 and cached.stats["prefix_entries"] == 3
        seconds = [req(r.prompt_ids + c.token_ids + (12, 13, 14), temperature=1.0, max_tokens=10, seed=80 + i)
                   for i, (r, c) in enumerate(zip(firsts, turn1))]
        fresh = [req(head + (20, 21), temperature=0.0, max_tokens=8), req((30, 31, 32), temperature=0.0, max_tokens=5)]
        batch = [seconds[0], fresh[0], seconds[1], fresh[1], seconds[2]]
        got, want = gen(cached, batch), gen(plain, batch)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        stats = cached.stats
        assert stats["prefix_hits"] == 4  # three next turns and the new episode; the short prompt has nothing to reuse
        whole = sum(len(r.prompt_ids) + len(c.token_ids) - 1 for r, c in zip(firsts, turn1))
        assert stats["prefix_tokens_reused"] == whole + len(head)
        # each next turn supersedes its first turn's entry
        assert stats["prefix_entries"] == 4, stats
        cached.load_weights({k: v.clone() for k, v in model.state_dict().items()}, version=1)
        assert cached.stats["prefix_entries"] == 0 and cached.stats["prefix_bytes"] == 0
        gen(cached, [seconds[0]])
        assert cached.stats["prefix_hits"] == 4  # nothing to reuse after the load


def test_n_samples_are_seeded_requests_in_place(engine, prompts):
    """`SamplingParams.n = 4` returns 4 completions in the request's place, equal to 4 requests seeded 9..12."""
    many = gen(engine, [req(prompts[0], max_tokens=3), req(prompts[1], max_tokens=10, seed=9, n=4),
                        req(prompts[2], max_tokens=3)])
    assert len(many) == 6 and len(many[0].token_ids) == len(many[5].token_ids) == 3
    samples = many[1:5]
    single = gen(engine, [req(prompts[1], max_tokens=10, seed=9 + j) for j in range(4)])
    assert [c.token_ids for c in samples] == [c.token_ids for c in single]
    assert len({c.token_ids for c in samples}) == 4  # different samples, not one sample four times
    unseeded = gen(engine, [req(prompts[1], max_tokens=10, n=3)])
    assert len(unseeded) == 3 and len({c.token_ids for c in unseeded}) == 3
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)


# ------------------------------------------------------------------------------------------------- (e) batching


def test_concurrent_calls_are_merged_into_few_batches(engine, prompts):
    async def many():
        return await asyncio.gather(*(engine.generate([req(prompts[i % 4], max_tokens=4, seed=i)])
                                      for i in range(200)))

    results = asyncio.run(many())
    assert len(results) == 200 and all(len(r) == 1 and len(r[0].token_ids) == 4 for r in results)
    assert engine.stats["requests"] == 200
    assert engine.stats["batches"] <= 8, engine.stats  # one call per batch would be 200
    assert isinstance(engine, Engine)


def test_calls_from_two_threads_and_loops(engine, prompts):
    requests = [req(prompts[i % 4], max_tokens=6, seed=i) for i in range(20)]
    expected = [c.token_ids for c in gen(engine, requests)]
    results: dict[int, list] = {}

    def worker(k: int) -> None:
        async def calls():
            return await asyncio.gather(*(engine.generate([r]) for r in requests))
        results[k] = [out[0].token_ids for out in asyncio.run(calls())]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a generate thread did not finish within 60 s"
    assert results[0] == expected and results[1] == expected


# --------------------------------------------------------------------------------------------- (f) weight loads


@pytest.mark.parametrize("as_delta", [False, True])
def test_load_weights_applies_between_batches(model, prompts, as_delta):
    """A full state or a sparse delta from version 0: the batch in flight finishes on version 0, the next batch
    equals an engine built on the new weights."""
    new_model = tiny_model(1)
    new_state = {k: v.clone() for k, v in new_model.state_dict().items()}
    if as_delta:
        new_state = make_delta(model.state_dict(), new_state, base_version=0, version=3)
    requests = [req(p, temperature=1.0, max_tokens=12, seed=i) for i, p in enumerate(prompts)]
    served = copy.deepcopy(model)
    with TorchEngine.from_model(copy.deepcopy(model)) as old_ref, TorchEngine.from_model(new_model) as new_ref, \
            TorchEngine.from_model(served, batch_window_s=0.0) as engine:
        old_expected, new_expected = gen(old_ref, requests), gen(new_ref, requests)
        # hold the batch inside its 5th forward (mid-decode) until the load has been requested
        in_decode, release, calls = threading.Event(), threading.Event(), []

        def gate(module, args, kwargs):
            calls.append(1)
            if len(calls) == 5:
                in_decode.set()
                assert release.wait(30), "test gate: release event not set within 30 s"

        handle = served.register_forward_pre_hook(gate, with_kwargs=True)
        loader = threading.Thread(target=engine.load_weights, args=(new_state, 3))
        try:
            in_flight = engine.submit(requests)
            assert in_decode.wait(30), "the batch did not reach its 5th forward within 30 s"
            loader.start()
            time.sleep(0.2)
            assert loader.is_alive() and engine.version == 0  # waits for the batch in flight
        finally:
            release.set()
        during = in_flight.result(timeout=60)
        loader.join(timeout=60)
        handle.remove()
        assert not loader.is_alive() and engine.version == 3
        for got, want in zip(during, old_expected):
            assert got.versions == (0,) * len(got.token_ids) and got.token_ids == want.token_ids
        after = gen(engine, requests)
        for got, want in zip(after, new_expected):
            assert got.versions == (3,) * len(got.token_ids) and got.token_ids == want.token_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-6, rtol=0)


def test_delta_loads_chain_and_equal_full_loads(model, prompts):
    """Deltas 0 -> 1 -> 2 (sparse: a few elements of a few tensors) give the weights, tokens and log-probs of a full
    load of version 2; the version tags change exactly at each load."""
    s0 = {k: v.clone() for k, v in model.state_dict().items()}
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["model.layers.0.mlp.up_proj.weight"][3, :7] += 0.5
    s2 = {k: v.clone() for k, v in s1.items()}
    s2["model.norm.weight"][::5] = -0.0
    s2["model.embed_tokens.weight"][9] *= -1.0  # tied: lm_head.weight is the same tensor, so it changes too
    s2["lm_head.weight"] = s2["model.embed_tokens.weight"]
    d1, d2 = make_delta(s0, s1, base_version=0, version=1), make_delta(s1, s2, base_version=1, version=2)
    assert set(d2.changes) == {"model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"}
    requests = [req(p, temperature=t, max_tokens=10, seed=i) for i, p in enumerate(prompts) for t in (0.0, 1.0)]
    full = copy.deepcopy(model)
    with TorchEngine.from_model(copy.deepcopy(model)) as engine, TorchEngine.from_model(full) as ref:
        for delta, version in ((d1, 1), (d2, 2)):
            engine.load_weights(delta, version)
            assert all(c.versions == (version,) * len(c.token_ids) for c in gen(engine, requests[:2]))
        ref.load_weights(s2, 2)
        for name, tensor in full.state_dict().items():
            assert torch.equal(engine._params[name].view(torch.int32), tensor.view(torch.int32)), name
        got, want = gen(engine, requests), gen(ref, requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.logprobs for c in got] == [c.logprobs for c in want]


def test_delta_load_needs_the_engines_version(engine, model, prompts):
    new_state = tiny_model(1).state_dict()
    before = {k: v.clone() for k, v in engine._params.items()}
    with pytest.raises(ValueError, match="engine is at version 0 and the delta needs base version 2; fetch a full"):
        engine.load_weights(make_delta(model.state_dict(), new_state, base_version=2, version=3), 3)
    with pytest.raises(ValueError, match="produces version 1, not 3"):
        engine.load_weights(make_delta(model.state_dict(), new_state, base_version=0, version=1), 3)
    renamed = make_delta({"x." + k: v for k, v in model.state_dict().items()},
                         {"x." + k: v for k, v in new_state.items()}, base_version=0, version=1)
    with pytest.raises(ValueError, match="not in the state"):
        engine.load_weights(renamed, 1)
    assert engine.version == 0
    assert all(torch.equal(before[k], v) for k, v in engine._params.items())
    [c] = gen(engine, [req(prompts[0], max_tokens=3)])
    assert c.versions == (0, 0, 0)


def test_load_weights_rejects_unknown_names(engine):
    with pytest.raises(KeyError, match="names the model lacks"):
        engine.load_weights({"not.a.param": torch.zeros(1)}, 1)
    name, param = next(iter(engine._model.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({name: torch.zeros(param.shape[0] + 1)}, 1)
    assert engine.version == 0


# ---------------------------------------------------------------------------------------------------- (g) errors


def test_model_error_reaches_callers_and_engine_keeps_serving(engine, prompts):
    def boom(module, args):
        raise RuntimeError("boom in forward")

    handle = engine._model.register_forward_pre_hook(boom)

    async def two_calls():
        return await asyncio.gather(engine.generate([req(prompts[0])]), engine.generate([req(prompts[1])]),
                                    return_exceptions=True)

    errors = asyncio.run(two_calls())
    handle.remove()
    assert all(isinstance(e, RuntimeError) and "boom" in str(e) for e in errors)
    [ok] = gen(engine, [req(prompts[0], max_tokens=3)])
    assert len(ok.token_ids) == 3 and engine.stats["errors"] == 1


def test_bad_requests_fail_at_their_caller(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        gen(engine, [req(())])
    with pytest.raises(ValueError, match="must lie in"):
        gen(engine, [req((1, VOCAB))])
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        gen(engine, [req((1, 2))])


def test_build_engine_from_a_model_directory(model, prompts, tmp_path):
    model.save_pretrained(tmp_path)
    requests = [req(p, temperature=1.0, max_tokens=6, seed=i) for i, p in enumerate(prompts)]
    with build_engine("torch", tmp_path, max_batch=2) as from_path, TorchEngine.from_model(copy.deepcopy(model)) as ref:
        assert from_path.tokenizer is None  # no tokenizer files saved
        got = gen(from_path, requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in gen(ref, requests)]
        assert from_path.stats["batches"] == 2 and from_path.stats["max_batch_seen"] == 2


# --------------------------------------------------------------------------------- sampler: μ is what is sampled


def test_counter_hash_is_splitmix64():
    """Golden values: splitmix64's finaliser in Python integers; torch int64 products must wrap the same way."""
    def mix(x: int) -> int:
        m = (1 << 64) - 1
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    values = [0, 1, 7, 2**40 + 3, 2**62 - 1]
    got = _mix64(torch.tensor(values)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [mix(v) for v in values]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_match_reported_distribution(temperature):
    """20000 rows of one distribution: token frequencies match exp(log-prob) within 5 standard errors."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.3, 1.5]).expand(20000, 8)
    temps = torch.full((20000,), temperature)
    tokens, lp = _sample(logits, temps, torch.arange(20000), step=3)
    p = torch.softmax(logits[0] / temperature, -1)
    torch.testing.assert_close(lp, torch.log(p)[tokens], atol=1e-5, rtol=0)
    freq = torch.bincount(tokens, minlength=8).double() / 20000
    se = (p.double() * (1 - p.double()) / 20000).sqrt()
    assert ((freq - p.double()).abs() <= 5 * se + 1e-4).all(), (freq, p)
    tokens_next, _ = _sample(logits, temps, torch.arange(20000), step=4)
    assert (tokens_next != tokens).float().mean() > 0.3  # a fresh draw per token index


def test_topk_logprobs_match_full_distribution_and_collate():
    """Top-K log-probs per token are the K largest of the sampled distribution (temperature applied), most likely
    first, and the sampled token's log-prob is consistent with them; collate lays them out [B, T, K]."""
    import asyncio

    from astratk.contracts import GenerationRequest, SamplingParams
    from astratk.records import Group, Task, Trajectory
    from astratk.training.collate import collate

    model = _topk_model()
    engine = TorchEngine.from_model(model)
    req = GenerationRequest((3, 4, 5, 6), SamplingParams(temperature=0.7, max_tokens=5, seed=1, top_k_logprobs=4))
    plain = GenerationRequest((3, 4, 5), SamplingParams(temperature=0.7, max_tokens=3, seed=2))
    c, c_plain = asyncio.run(engine.generate([req, plain]))
    engine.close()
    assert c_plain.topk_ids == () and len(c.topk_ids) == len(c.token_ids) and len(c.topk_ids[0]) == 4
    ids = torch.tensor([list(req.prompt_ids) + list(c.token_ids)])
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[0, 3:-1].float() / 0.7, -1)  # [N, V]
    for j, (top_ids, top_lp) in enumerate(zip(c.topk_ids, c.topk_logprobs)):
        want_lp, want_ids = full[j].topk(4)
        assert list(top_ids) == want_ids.tolist()
        assert torch.allclose(torch.tensor(top_lp), want_lp, atol=1e-5)
        assert c.logprobs[j] <= top_lp[0] + 1e-6
    n = len(c.token_ids)
    traj = Trajectory(task_id="t", group_id="g/0", policy_id="main", role="policy", tokens=req.prompt_ids + c.token_ids,
                      n_prompt=4, loss_mask=(1,) * n, behavior_logprobs=c.logprobs, behavior_versions=c.versions,
                      reward=1.0, behavior_topk_ids=c.topk_ids, behavior_topk_logprobs=c.topk_logprobs)
    batch = collate([Group("g", Task("t", "e", "p"), "main", (traj,), advantages=(0.5,))], pad_id=0)
    assert batch.topk_ids.shape == (1, 3 + n, 4)
    assert batch.topk_ids[0, 3].tolist() == list(c.topk_ids[0]) and batch.topk_ids[0, 2].tolist() == [0] * 4
    assert torch.allclose(batch.topk_behavior_logprobs[0, 3], torch.tensor(c.topk_logprobs[0]))


def _topk_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=128, tie_word_embeddings=True, initializer_range=0.1)
    return Qwen2ForCausalLM(cfg).eval()


# ------------------------------------------------------------------------------------ start-up and many episodes
def test_engine_that_fails_to_start_names_the_cause(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory at .*nope"):
        build_engine("torch", tmp_path / "nope")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(RuntimeError, match=r"cannot load the model in .*model.safetensors"):
        build_engine("torch", tmp_path)


def test_hundreds_of_multi_turn_episodes_from_threads(engine, prompts):
    """300 three-turn episodes from 3 threads' event loops complete (no deadlock) and share batches."""

    async def episode(i: int) -> int:
        ids = list(prompts[i % 4])
        for turn in range(3):
            [c] = await engine.generate([req(tuple(ids), max_tokens=4, seed=i * 7 + turn)])
            ids += list(c.token_ids)
        return len(ids) - len(prompts[i % 4])

    results: list[list[int]] = []

    def loop(lo: int) -> None:
        async def many():
            return await asyncio.gather(*(episode(i) for i in range(lo, lo + 100)))
        results.append(asyncio.run(many()))

    threads = [threading.Thread(target=loop, args=(lo,)) for lo in (0, 100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "episodes deadlocked"
    assert sorted(map(len, results)) == [100, 100, 100] and all(n == 12 for r in results for n in r)
    assert engine.stats["requests"] == 900 and engine.stats["batches"] < 90  # merged, not one batch per call


def test_hundreds_of_episodes_while_weights_load(model, prompts):
    """300 episodes from 3 threads while another thread alternates two weight states every ~20 ms: no deadlock,
    every completion comes from one version, and its tokens are that version's (checked against reference engines).
    The loader waits until versions 1 and 2 have each served a completion, and second turns wait for version 2, so
    both states are seen however loaded the machine is and however fast the engine (runs have seen only one)."""
    states = {1: {k: v.clone() for k, v in tiny_model(1).state_dict().items()},
              2: {k: v.clone() for k, v in model.state_dict().items()}}
    served: list[tuple[GenerationRequest, object]] = []
    stop = threading.Event()
    with TorchEngine.from_model(copy.deepcopy(model), batch_window_s=0.005) as engine:

        def loader() -> None:
            version = 0
            while not stop.is_set():
                version += 1
                engine.load_weights(states[2 - version % 2], version)
                if version <= 2:  # on a loaded machine the episodes could otherwise all land on one parity: wait
                    deadline = time.monotonic() + 60  # until each of the first two versions served a completion
                    while not stop.is_set() and time.monotonic() < deadline and not any(
                            c.versions[0] == version for _, c in list(served)):
                        time.sleep(0.002)
                time.sleep(0.02)

        async def episode(i: int) -> None:
            ids = list(prompts[i % 4])
            for turn in range(2):
                deadline = time.monotonic() + 60
                while turn == 1 and engine.version < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)  # a fast engine could finish every episode before the second load
                r = req(tuple(ids), max_tokens=3, seed=i * 5 + turn)
                [c] = await engine.generate([r])
                served.append((r, c))
                ids += list(c.token_ids)

        def loop(lo: int) -> None:
            async def many():
                await asyncio.gather(*(episode(i) for i in range(lo, lo + 100)))
            asyncio.run(many())

        load_thread = threading.Thread(target=loader, daemon=True)
        load_thread.start()
        threads = [threading.Thread(target=loop, args=(lo,)) for lo in (0, 100, 200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        stop.set()
        load_thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads) and not load_thread.is_alive(), "episodes or loads deadlocked"
        assert engine.version >= 2, "the loader never got between batches"
    assert len(served) == 600
    assert all(len(set(c.versions)) == 1 for _, c in served)
    by_state: dict[int, list[tuple[GenerationRequest, object]]] = {0: [], 1: []}
    for r, c in served:
        by_state[c.versions[0] % 2].append((r, c))  # odd versions: model 1's weights; even ones: the start model's
    assert by_state[0] and by_state[1], "the episodes did not see both weight states"
    with TorchEngine.from_model(tiny_model(1)) as odd, TorchEngine.from_model(copy.deepcopy(model)) as even:
        for parity, ref in ((1, odd), (0, even)):
            sample = by_state[parity][:40]
            want = gen(ref, [r for r, _ in sample])
            assert [c.token_ids for _, c in sample] == [w.token_ids for w in want]


@pytest.mark.parametrize("mask", ["bool", "float", None])
def test_bf16_decode_attention_equals_sdpa_on_a_view_of_the_cache(mask):
    """The bf16 decode step's attention (two matmuls, softmax in fp32) equals torch's sdpa in fp32 on the same inputs
    to bf16 rounding, with padding masked either way or no mask, on K/V that are views of a larger cache."""
    import torch.nn.functional as F

    from astratk.engines.torch_kvcache import _decode_attention

    g = torch.Generator().manual_seed(4)
    b, h, kv, d, n = 3, 6, 2, 16, 21
    q = torch.randn(b, h, 1, d, generator=g)
    k_store, v_store = torch.randn(b, kv, n + 7, d, generator=g), torch.randn(b, kv, n + 7, d, generator=g)
    k, v = k_store[:, :, :n], v_store[:, :, :n]
    attend = torch.ones(b, 1, 1, n, dtype=torch.bool)
    attend[0, ..., :5] = False  # left padding of row 0
    attend[2, ..., 8:10] = False  # padding inside row 2 (a reused prefix, then the rest of its prompt)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=attend if mask else None, scale=0.3,
                                          enable_gqa=True).transpose(1, 2)
    given = {"bool": attend, "float": torch.zeros(b, 1, 1, n).masked_fill(~attend, float("-inf")).bfloat16(),
             None: None}[mask]
    got = _decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), given, 0.3)
    assert got.dtype == torch.bfloat16 and got.shape == (b, 1, h, d)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_a_bf16_engine_samples_what_its_model_gives_in_bf16(model, prompts):
    """A bf16 engine's greedy tokens equal HF's own bf16 forward step by step, and its log-probs agree with them to
    bf16 rounding (the decode steps go through `_decode_attention`)."""
    with TorchEngine.from_model(copy.deepcopy(model).bfloat16()) as engine:
        out = gen(engine, [req(p, temperature=0.0, max_tokens=6) for p in prompts])
    ref = copy.deepcopy(model).bfloat16()
    for p, c in zip(prompts, out):
        ids = torch.tensor([list(p)])
        for t, lp in zip(c.token_ids, c.logprobs):
            with torch.inference_mode():
                logits = ref(input_ids=ids).logits[0, -1].float()
            assert t == int(logits.argmax()) or logits.max() - logits[t] < 0.1  # a near-tie may flip in bf16
            assert abs(lp - float(logits.log_softmax(-1)[t])) < 0.05
            ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
