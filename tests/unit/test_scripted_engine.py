"""ScriptedEngine: the deterministic test double meets the Engine contract the way TorchEngine does."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from astratk.contracts import Engine, GenerationRequest, SamplingParams
from astratk.engines import ScriptedEngine, build_engine
from astratk.envs.math.arithmetic import ArithmeticEnv


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
    tok = object()  # any tokenizer object is kept as given (a str or path names a model directory)
    engine = ScriptedEngine(tok, lambda prompt, params: [len(prompt), int(params.temperature * 10)])
    [c] = gen(engine, [req((7, 8, 9), temperature=0.5)])
    assert c.token_ids == (3, 5) and engine.tokenizer is tok


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
    import astratk.engines as engines_module
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
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

    monkeypatch.setattr(engines_module, "resolve", lambda kind, name: Breakable)
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


def test_a_run_spec_with_the_scripted_engine_rolls_out_and_scores(tmp_path):
    """`rollout.engine: scripted` from a spec: the service builds every engine from the policy's model directory with
    `rollout.max_batch`, which ScriptedEngine (it answers at once) does not take; it gets the directory's tokenizer,
    which the env encodes prompts with, and its script from `rollout.engine_args`."""
    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer
    from astratk.models import build_char_tokenizer
    from astratk.models.tokenizer import save_char_tokenizer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.spec import DataflowSpec, RolloutSpec, RunSpec

    tok = build_char_tokenizer()
    save_char_tokenizer(tok, tmp_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    spec = RunSpec(rollout=RolloutSpec(engine="scripted", group_size=2, max_batch=4),
                   dataflow=DataflowSpec(filter_zero_variance=False)).validate()
    [lease] = DataLayerClient(DataLayer(spec)).lease(1)
    answer = list(tok(spec.env.demonstration(lease.task), add_special_tokens=False)["input_ids"]) + [end]
    spec.rollout.engine_args = {"script": [answer]}
    service = RolloutService(RunContext("scripted-spec", spec, {"main": str(tmp_path)}, "memory://scripted-spec"))
    engine = service.engine("main")
    assert isinstance(engine, ScriptedEngine) and engine.tokenizer.convert_tokens_to_ids("<|im_end|>") == end
    [scored] = service.score(service.rollout([lease]))
    [group] = scored.groups
    assert [t.reward for t in group.trajectories] == [1.0, 1.0]  # the demonstration, encoded by the loaded tokenizer
    assert engine.requests[0].prompt_ids == tuple(group.trajectories[0].tokens[:group.trajectories[0].n_prompt])


def test_engine_arguments_the_constructor_cannot_take_fail_naming_what_it_takes():
    with pytest.raises(TypeError, match=r"engine 'astratk.engines.scripted.ScriptedEngine' .* takes no argument "
                                        r"\['batch_window_s'\] \(rollout.engine_args\); its constructor takes "
                                        r"\['delay_s', 'logprob', 'max_model_len', 'script', 'version'\]"):
        build_engine("astratk.engines.scripted.ScriptedEngine", None, batch_window_s=0.01)
    # run-wide settings reach only the constructors that take them; the engine's own arguments override them
    engine = build_engine("scripted", None, run_settings={"max_batch": 4, "version": 1}, version=3)
    assert engine.version == 3
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        ScriptedEngine("no/such/model")


class _LetterEnv(ArithmeticEnv):
    """Arithmetic whose answer is right when the completion says Y (a test's grader)."""

    def grade(self, task, text):
        return float(text.strip().startswith("Y"))


def test_evaluation_reports_pass_at_k_and_the_mean_of_the_samples(tmp_path):
    """eval.pass_k: k samples per held-out task at the rollout temperature give pass@k and mean@k
    (`sampled_accuracy`). Here greedy always answers right and the samples alternate right and wrong, so mean@k is
    exactly 1/2 while the greedy accuracy is 1: the room a greedy metric near 1 leaves no longer hides progress."""
    import itertools

    from astratk.models import build_char_tokenizer
    from astratk.models.tokenizer import save_char_tokenizer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.spec import RolloutSpec, RunSpec

    tok = build_char_tokenizer()
    save_char_tokenizer(tok, tmp_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    yes = [*tok("Y", add_special_tokens=False)["input_ids"], end]
    no = [*tok("N", add_special_tokens=False)["input_ids"], end]
    turn = itertools.cycle([yes, no])
    script = lambda prompt, params: yes if params.temperature == 0 else next(turn)
    spec = RunSpec(env=_LetterEnv(levels=[1], n_heldout=6),
                   rollout=RolloutSpec(engine="scripted", group_size=2, temperature=1.0, max_new_tokens=4,
                                       engine_args={"script": script})).validate()
    service = RolloutService(RunContext("pass-k", spec, {"main": str(tmp_path)}, "memory://pass-k"))
    out = service.evaluate_versions({"main": None}, max_tasks=6, pass_k=4)
    assert out["accuracy"] == 1.0 and out["sampled_accuracy"] == 0.5
    assert 0.0 < out["pass_at_4"] <= 1.0


def test_an_evaluation_counts_the_episodes_it_scored_0_for_running_out_of_time(tmp_path):
    """A held-out episode past `rollout.episode_timeout_s` is scored 0 (evaluation drops no task) and counted, and the
    run's evaluation line says so: a 0.000 that comes from slow workers must not read as a model that forgot."""
    from astratk.models import build_char_tokenizer
    from astratk.models.tokenizer import save_char_tokenizer
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService
    from astratk.runtime.live_metrics import _lost_episodes
    from astratk.spec import RolloutSpec, RunSpec

    tok = build_char_tokenizer()
    save_char_tokenizer(tok, tmp_path)
    yes = [*tok("Y", add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids("<|im_end|>")]

    spec = RunSpec(env=_LetterEnv(levels=[1], n_heldout=3),
                   rollout=RolloutSpec(engine="scripted", max_new_tokens=4, episode_timeout_s=0.1,
                                       engine_args={"script": [yes], "delay_s": 0.5})).validate()
    service = RolloutService(RunContext("late", spec, {"main": str(tmp_path)}, "memory://late"))
    out = service.evaluate_versions({"main": None}, max_tasks=3)
    assert out["accuracy"] == 0.0 and out["n"] == 3 and out["episodes_timed_out"] == 3
    assert "3 ran past rollout.episode_timeout_s" in _lost_episodes(out)
    assert _lost_episodes({**out, "episodes_timed_out": 0.0}) == ""
