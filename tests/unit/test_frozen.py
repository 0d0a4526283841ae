"""Frozen models (`FrozenSpec`): their own sampling and counts in an episode, the rules a spec must keep, the YAML key,
their resource labels, and the data layer counting their trajectories without training on them."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from astratk.config import parse
from astratk.contracts import GenerationRequest, SamplingParams
from astratk.dataflow.datalayer import DataLayer
from astratk.engines.scripted import ScriptedEngine
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows import SolverVerifierEnv
from astratk.records import Group, Trajectory
from astratk.rollout.frozen import FrozenCalls, frozen_engines, with_counts
from astratk.runtime.pools import rollout_labels
from astratk.spec import ClusterSpec, DataflowSpec, FrozenSpec, LoraSpec, ModelSpec, PolicySpec, RunSpec, WarmStartSpec
from astratk.spec.model import TinyModelSpec

ENV = SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=4))


def spec(**frozen) -> RunSpec:
    return RunSpec(env=ENV, policies=[PolicySpec(policy_id="solver", roles=["solver"])],
                   frozen=[FrozenSpec(**{"name": "checker", "roles": ["verifier"], **frozen})],
                   dataflow=DataflowSpec(filter_zero_variance=False))


def test_a_frozen_engine_applies_its_own_sampling_and_counts_each_reply():
    seen: list[SamplingParams] = []

    def script(prompt, params):
        seen.append(params)
        return [5, 6, 7, 8]

    user = FrozenCalls(ScriptedEngine(None, script), "user", temperature=0.0, max_new_tokens=2)
    out = asyncio.run(user.generate([GenerationRequest((1, 2), SamplingParams(temperature=1.0, max_tokens=9))] * 2))
    assert [c.token_ids for c in out] == [(5, 6), (5, 6)]
    assert all(p.temperature == 0.0 and p.max_tokens == 2 for p in seen)
    m = user.metrics()
    assert (m["frozen/user/calls"], m["frozen/user/tokens"]) == (2.0, 4.0) and m["frozen/user/seconds"] >= 0.0
    capped = FrozenCalls(ScriptedEngine(None, script), "user", max_new_tokens=8)  # a cap, never a longer budget
    asyncio.run(capped.generate([GenerationRequest((1,), SamplingParams(max_tokens=3))]))
    assert seen[-1].max_tokens == 3
    plain = FrozenCalls(ScriptedEngine(None, script), "user")  # nothing given: the env's sampling as it asked
    asyncio.run(plain.generate([GenerationRequest((1,), SamplingParams(temperature=0.7, max_tokens=3))]))
    assert (seen[-1].temperature, seen[-1].max_tokens) == (0.7, 3)


def test_each_episode_counts_apart_and_a_model_of_two_roles_counts_once():
    s = RunSpec(env=ENV, policies=[PolicySpec(policy_id="p", roles=["solver"])],
                frozen=[FrozenSpec(name="f", roles=["verifier"])])
    engine = ScriptedEngine(None, [[1]] * 10)
    engines, counters = frozen_engines({"solver": engine, "verifier": engine}, s.role_routes(), s)
    assert engines["solver"] is engine and isinstance(engines["verifier"], FrozenCalls)
    _, other = frozen_engines({"solver": engine, "verifier": engine}, s.role_routes(), s)
    assert other[0] is not counters[0]  # a fresh count per episode
    two = dataclasses.replace(s, frozen=[FrozenSpec(name="f", roles=["solver", "verifier"])])
    engines, counters = frozen_engines({"solver": engine, "verifier": engine}, {"solver": "f", "verifier": "f"}, two)
    assert len(counters) == 1 and engines["solver"] is engines["verifier"]
    t = Trajectory(task_id="t", group_id="g/0", policy_id="p", role="solver", tokens=(1, 2), n_prompt=1,
                   loss_mask=(1,), behavior_logprobs=(-1.0,), behavior_versions=(0,), metrics={"turns": 1.0})
    [counted] = with_counts([t], counters)
    assert counted.metrics == {"turns": 1.0, "frozen/f/calls": 0.0, "frozen/f/tokens": 0.0, "frozen/f/seconds": 0.0}


def test_the_spec_routes_roles_to_frozen_models_and_labels_their_workers():
    s = spec().validate()
    assert s.role_routes() == {"solver": "solver", "verifier": "checker"}
    assert s.served_ids() == ["solver", "checker"] and s.frozen_model("checker").roles == ["verifier"]
    assert s.frozen_model("solver") is None
    assert set(rollout_labels(s.served_ids())) == {"rollout_solver", "rollout_checker", "score"}


@pytest.mark.parametrize(("change", "match"), [
    ({"name": "solver"}, r"frozen\[0\]\.name: 'solver' is already the name of a policy"),
    ({"name": ""}, r"frozen\[0\]\.name: give a non-empty name"),
    ({"roles": []}, r"frozen\[0\]\.roles: give the env roles"),
    ({"roles": "verifier"}, r"frozen\[0\]\.roles: expected a list"),
    ({"roles": ["critic"]}, r"frozen\[0\]\.roles: env 'solver_verifier' has no role 'critic'"),
    ({"roles": ["solver"]}, r"frozen\[0\]\.roles: role 'solver' is already played by 'solver'"),
    ({"model": ModelSpec(lora=LoraSpec(r=4))}, r"frozen\[0\]\.model\.lora: a frozen model trains nothing"),
    ({"model": ModelSpec(path="/nonexistent/model")}, r"frozen\[0\]\.model\.path: '/nonexistent/model' does not exist"),
    ({"temperature": -1.0}, r"frozen\[0\]\.temperature"),
    ({"max_new_tokens": 0}, r"frozen\[0\]\.max_new_tokens"),
    ({"engine": "nosuch"}, r"frozen\[0\]\.engine: unknown engine 'nosuch'"),
])
def test_a_bad_frozen_model_is_refused_naming_its_key(change, match):
    with pytest.raises(ValueError, match=match):
        spec(**change).validate()


def test_a_frozen_model_is_never_warm_started(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"frozen\[0\]\.model\.warm_start: a frozen model is served as it is"):
        spec(model=ModelSpec(path=str(tmp_path), warm_start=WarmStartSpec())).validate()


def test_the_first_role_must_be_trained_and_pools_must_carry_the_frozen_label():
    first = RunSpec(env=ENV, policies=[PolicySpec(policy_id="v", roles=["verifier"])],
                    frozen=[FrozenSpec(name="f", roles=["solver"])])
    with pytest.raises(ValueError, match="first role 'solver'.*a trained policy must play it"):
        first.validate()
    from astratk.spec import WorkerClass

    pools = dataclasses.replace(spec(), cluster=ClusterSpec(pools=[WorkerClass("gpu", 1, resources={
        "rollout_solver": 1, "score": 1})]))
    with pytest.raises(ValueError, match=r"cluster\.pools: no worker carries \['rollout_checker'\]"):
        pools.validate()


def test_a_yaml_run_names_its_frozen_models(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("""
env: {class_path: solver_verifier, init_args: {base: {class_path: arithmetic}}}
policies:
  - {policy_id: solver, roles: [solver]}
frozen:
  - name: user
    roles: [verifier]
    model: {tiny: {hidden_size: 64, num_heads: 2, num_kv_heads: 1, num_layers: 1}}
    temperature: 0.0
    max_new_tokens: 12
    engine_args: {max_batch: 8}
""")
    s = parse(["--config", str(path)])
    [f] = s.frozen
    assert (f.name, f.roles, f.temperature, f.max_new_tokens, f.engine_args) == ("user", ["verifier"], 0.0, 12,
                                                                               {"max_batch": 8})
    assert isinstance(f.model.tiny, TinyModelSpec) and f.model.tiny.hidden_size == 64


def test_the_data_layer_counts_a_frozen_models_groups_and_never_serves_them():
    dl = DataLayer(spec())
    leases = dl.lease(1)

    def group(pid: str, role: str) -> Group:
        trajs = tuple(Trajectory(task_id=leases[0].task.task_id, group_id=f"{leases[0].lease_id}/{i}", policy_id=pid,
                                 role=role, tokens=(1, 2, 3), n_prompt=1, loss_mask=(1, 1),
                                 behavior_logprobs=(-1.0, -1.0), behavior_versions=(0, 0), reward=float(i % 2),
                                 metrics={"frozen/checker/calls": 1.0, "frozen/checker/tokens": 2.0,
                                          "frozen/checker/seconds": 0.5})
                      for i in range(4))
        return Group(group_id=f"{leases[0].lease_id}/{role}", task=leases[0].task, policy_id=pid, trajectories=trajs)

    dl.admit(leases[0].lease_id, [group("solver", "solver"), group("checker", "verifier")])
    m = dl.metrics()
    assert m["data/solver/groups_admitted"] == 1
    assert m["data/frozen/checker/trajectories"] == 4 and m["data/frozen/checker/tokens"] == 8
    assert (m["data/frozen/checker/episodes"], m["data/frozen/checker/episode_calls"]) == (4, 4)
    assert m["data/frozen/checker/episode_ms"] == 2000
    assert not any(k.startswith("data/checker/") for k in m)  # no policy of that name: nothing queued for it
    assert dl.drops() == [] or all(d.policy_id != "checker" for d in dl.drops())


def test_a_frozen_model_that_cannot_load_is_refused_at_start_in_one_line(tmp_path):
    """Nothing loads a frozen model on the driver's machine before a rollout worker does, so the start checks it:
    a config transformers cannot read, no weights, no tokenizer: each a one-line StartError naming the key."""
    from transformers import Qwen2Config

    from astratk.models import build_char_tokenizer
    from astratk.models.tokenizer import save_char_tokenizer
    from astratk.runtime.checks import check_frozen_model
    from astratk.spec import StartError

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(StartError, match=r"^frozen\[0\]\.model: .*broken cannot be loaded as a model: ") as e:
        check_frozen_model(broken, "frozen[0].model")
    assert "\n" not in str(e.value)
    bare = tmp_path / "bare"
    Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=128, vocab_size=300).save_pretrained(bare)
    with pytest.raises(StartError, match=r"frozen\[0\]\.model: .*bare holds no weights"):
        check_frozen_model(bare, "frozen[0].model")
    (bare / "model.safetensors").write_bytes(b"")
    with pytest.raises(StartError, match=r"frozen\[0\]\.model: .*bare holds no tokenizer"):
        check_frozen_model(bare, "frozen[0].model")
    save_char_tokenizer(build_char_tokenizer(), bare)
    check_frozen_model(bare, "frozen[0].model")  # config, weights, tokenizer: served as it is
