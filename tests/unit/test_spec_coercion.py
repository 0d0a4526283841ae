"""The Python API takes what YAML takes (`astratk.coerce`): sections as dicts, plug-ins as short names, dotted paths
or {class_path, init_args}; anything else fails in one line that names the field and the type it wants."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astratk.coerce import SpecTypeError
from astratk.config import load_spec
from astratk.losses.dppo import DPPO
from astratk.losses.drpo import DRPO
from astratk.spec import ClusterSpec, DataflowSpec, LoraSpec, ModelSpec, PolicySpec, RolloutSpec, RunSpec


def test_sections_given_as_dicts_become_their_types():
    m = ModelSpec(lora={"r": 16, "alpha": 32})
    assert m.lora == LoraSpec(r=16, alpha=32.0) and isinstance(m.lora.alpha, float)
    spec = RunSpec(policies=[{"policy_id": "p", "model": {"lora": {"r": 4}}, "trainer": {"max_steps": 3}}],
                   rollout={"group_size": 4}, cluster={"pools": [{"name": "fast", "count": 2}]})
    [p] = spec.policies
    assert isinstance(p, PolicySpec) and p.model.lora.r == 4 and p.trainer.max_steps == 3
    assert spec.rollout.group_size == 4 and spec.cluster.pools[0].count == 2
    spec.validate()


def test_plugins_by_short_name_dotted_path_or_class_path():
    assert isinstance(PolicySpec(loss="drpo").loss, DRPO)
    assert isinstance(PolicySpec(loss="astratk.losses.dppo.DPPO").loss, DPPO)
    assert PolicySpec(loss={"class_path": "drpo", "init_args": {"delta": 0.5}}).loss.delta == 0.5
    assert RunSpec(env="arithmetic").env.name == "arithmetic"
    d = DataflowSpec(filters=["length_filter"], order="edf")
    assert type(d.filters[0]).__name__ == "LengthFilter" and type(d.order).__name__ == "EDF"


def test_paths_and_numbers_are_converted():
    assert RunSpec(output_dir=Path("/tmp/x")).output_dir == "/tmp/x"
    r = RolloutSpec(temperature=1)
    assert r.temperature == 1.0 and isinstance(r.temperature, float)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: ModelSpec(lora={"rank": 16}),
     "model.lora: unknown key 'rank'; LoraSpec takes alpha, dropout, r, target_modules"),
    (lambda: ModelSpec(lora=[16]), "model.lora: expected a LoraSpec or a dict of its fields"),
    (lambda: RunSpec(policies=[{}, {"model": {"lora": {"r": "16"}}}]),
     "policies[1].model.lora.r: expected an integer, got str '16'"),
    (lambda: PolicySpec(loss="nope"), "policies[0].loss: unknown loss 'nope'; choose one of"),
    (lambda: PolicySpec(loss={"class_path": "drpo", "init_args": {"delt": 1}}),
     "policies[0].loss: drpo does not take these arguments"),
    (lambda: PolicySpec(loss={"class_path": "drpo", "delta": 1}), "unknown key 'delta' next to class_path"),
    (lambda: PolicySpec(loss="astratk.dataflow.stages.filters.ZeroVariance"), "is a ZeroVariance, not a PolicyLoss"),
    (lambda: RunSpec(env=3), "env: expected an Env (an instance, a short name such as 'arithmetic'"),
    (lambda: RolloutSpec(temperature="hot"), "rollout.temperature: expected a number, got str 'hot'"),
    (lambda: RolloutSpec(temperature=True), "rollout.temperature: expected a number"),
    (lambda: ClusterSpec(pools=[{"name": "a", "count": "x"}]), "cluster.pools[0].count: expected an integer"),
    (lambda: DataflowSpec(filters="zero_variance"), "dataflow.filters: expected a list of"),
    (lambda: RunSpec(rollout=[1]), "rollout: expected a RolloutSpec or a dict of its fields"),
    (lambda: RunSpec(policies={"policy_id": "x"}), "policies: expected a list of PolicySpecs"),
])
def test_wrong_types_fail_in_one_line_naming_the_field(build, message):
    with pytest.raises(SpecTypeError) as e:
        build()
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)  # the CLI and notebooks treat it as any config error


def test_yaml_and_python_build_the_same_spec(tmp_path):
    text = {"policies": [{"model": {"lora": {"r": 16, "alpha": 32}},
                          "loss": {"class_path": "drpo", "init_args": {"delta": 0.5}}}],
            "rollout": {"group_size": 4}}
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(text))
    from_yaml = load_spec(tmp_path / "x.yaml")
    from_python = RunSpec(**text)
    assert from_yaml.policies[0].model == from_python.policies[0].model
    assert from_yaml.policies[0].loss.delta == from_python.policies[0].loss.delta == 0.5
    assert from_yaml.rollout == from_python.rollout
