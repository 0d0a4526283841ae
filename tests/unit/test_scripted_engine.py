"""ScriptedEngine: the deterministic test double meets the Engine contract the way TorchEngine does."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from astratk.contracts import Engine, GenerationRequest, SamplingParams
from astratk.engines import ScriptedEngine, build_engine


def gen(engine, requests):
    return asyncio.run(asyncio.wait_for(engine.generate(requests), 10))


def req(prompt=(1, 2), **params) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(**params))


def test_list_script_cycles_in_order():
    engine = ScriptedEngine(None, [[1, 2], [3], [4, 5, 6]])
    got = [c.token_ids for c in gen(engine, [req() for _ in range(4)])]
    assert got == [(1, 2), (3,), (4, 5, 6), (1, 2)]
    assert len(engine.requests) == 4 and isinstance(engine, Engine)


def test_callable_script_sees_prompt_and_params():
    engine = ScriptedEngine("tok", lambda prompt, params: [len(prompt), int(params.temperature * 10)])
    [c] = gen(engine, [req((7, 8, 9), temperature=0.5)])
    assert c.token_ids == (3, 5) and engine.tokenizer == "tok"


def test_n_samples_expand_in_place_with_consecutive_seeds():
    engine = ScriptedEngine(None, lambda prompt, params: [params.seed if params.seed is not None else 99])
    got = gen(engine, [req(seed=5, n=3), req(max_tokens=1), req(n=2)])
    assert [c.token_ids for c in got] == [(5,), (6,), (7,), (99,), (99,), (99,)]
    assert all(r.params.n == 1 for r in engine.requests) and len(engine.requests) == 6


def test_stops_truncation_and_finish_reason():
    engine = ScriptedEngine(None, [[5, 6, 7, 6, 8]])
    stop, budget, both, plain = gen(engine, [req(stop_token_ids=(6,)), req(max_tokens=2), req(max_tokens=2,
                                                                                                stop_token_ids=(7,)),
                                             req(max_tokens=16)])
    assert stop.token_ids == (5, 6) and stop.finish_reason == "stop"  # cut after the first stop, which is kept
    assert budget.token_ids == (5, 6) and budget.finish_reason == "length"
    assert both.token_ids == (5, 6) and both.finish_reason == "length"  # the budget ends it before the stop
    assert plain.token_ids == (5, 6, 7, 6, 8) and plain.finish_reason == "length"


def test_logprobs_versions_and_loads():
    engine = ScriptedEngine(None, [[1, 2, 3]], logprob=-0.25)
    [c] = gen(engine, [req()])
    assert c.logprobs == (-0.25,) * 3 and c.versions == (0,) * 3
    engine.load_weights({"b": torch.zeros(1), "a": torch.ones(2)}, version=4)
    [c] = gen(engine, [req()])
    assert engine.version == 4 and c.versions == (4, 4, 4)
    assert engine.loads == [(4, ("a", "b"))]
    [d] = gen(ScriptedEngine(None, [[1]]), [req()])
    assert d.logprobs == (pytest.approx(math.log(0.5)),)


def test_bad_scripts_fail_loudly():
    with pytest.raises(ValueError, match="empty list"):
        ScriptedEngine(None, [])
    with pytest.raises(ValueError, match="no tokens"):
        gen(ScriptedEngine(None, lambda p, s: []), [req()])


def test_build_engine_by_short_name():
    engine = build_engine("scripted", None, script=[[9]])
    assert isinstance(engine, ScriptedEngine) and gen(engine, [req()])[0].token_ids == (9,)
    with pytest.raises(ValueError, match="choose one of"):
        build_engine("nope", None)


def test_rollout_service_rebuilds_a_broken_engine(monkeypatch):
    """An engine whose weight load failed half-way reports `broken` (VLLMEngine); the service closes it and builds
    a new one at the next use instead of failing every rollout from then on."""
    from astratk.rollout import service as service_module
    from astratk.rollout.service import RolloutService, RunContext
    from astratk.spec import RolloutSpec, RunSpec

    built: list[ScriptedEngine] = []

    class Breakable(ScriptedEngine):
        broken = None

        def __init__(self, path, **kwargs):
            super().__init__(None, [[1]])
            self.closed = False
            built.append(self)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(service_module, "resolve", lambda kind, name: Breakable)
    spec = RunSpec(rollout=RolloutSpec(engine="scripted")).validate()
    service = RolloutService(RunContext("broken", spec, {"main": None}, "memory://broken-engine"))
    first = service.engine("main")
    assert service.engine("main") is first and len(built) == 1
    first.broken = RuntimeError("VLLMEngine is broken: ...")
    assert service.engine("main") is first  # handed out as is outside sync: its calls fail naming the cause
    with pytest.warns(UserWarning, match="rebuilding the rollout engine of policy 'main'"):
        assert service.sync("main") == 0  # nothing published: the new engine stays at version 0
    second = service.engine("main")
    assert second is not first and first.closed and len(built) == 2
