"""A run with a frozen model beside its policy: the solver trains, a frozen verifier (a tiny model of its own,
greedy) judges each answer in the episodes, and nothing it generates is trained on; its calls are counted."""

from __future__ import annotations

import pytest

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows import SolverVerifierEnv
from astratk.metrics import load
from astratk.runtime.run import Run
from astratk.spec import (
    ClusterSpec,
    DataflowSpec,
    EvalSpec,
    FrozenSpec,
    ModelSpec,
    PolicySpec,
    RolloutSpec,
    RunSpec,
    TinyModelSpec,
    TrainerSpec,
)

pytestmark = pytest.mark.integration


def spec(tmp_path) -> RunSpec:
    model = ModelSpec(tiny=TinyModelSpec(warm_start_steps=20, warm_start_batch=16), cache_dir=str(tmp_path / "cache"))
    checker = ModelSpec(tiny=TinyModelSpec(warm_start_steps=0, hidden_size=64, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=128),
                        cache_dir=str(tmp_path / "cache"))
    return RunSpec(
        name="frozen", output_dir=str(tmp_path / "runs"),
        env=SolverVerifierEnv(ArithmeticEnv(levels=[1], n_heldout=8), retry=False),
        policies=[PolicySpec(policy_id="solver", roles=["solver"], model=model,
                             trainer=TrainerSpec(max_steps=3, groups_per_step=2, batch_timeout_s=120))],
        frozen=[FrozenSpec(name="checker", roles=["verifier"], model=checker, temperature=0.0, max_new_tokens=3)],
        rollout=RolloutSpec(group_size=4, max_new_tokens=8, tasks_per_chunk=2),
        dataflow=DataflowSpec(filter_zero_variance=False),
        cluster=ClusterSpec(rollout_workers=1, startup_timeout_s=120, processes=False),
        eval=EvalSpec(interval_s=1e6, max_tasks=8, timeout_s=120))


def test_a_frozen_model_plays_its_role_is_counted_and_never_trained(tmp_path):
    lines: list[str] = []
    result = Run(spec(tmp_path), printer=lines.append).start()
    assert result.summary["final_version"] == 3
    assert any(line.startswith("frozen model 'checker' for role(s) verifier:") for line in lines), lines
    ds = load(result.files["metrics"])
    assert list(ds["policy"].values) == ["solver"]  # the frozen model is no policy: no trainer, no versions
    calls = float(ds["data_traj_solver_frozen_checker_calls_mean"].sel(policy="solver"))
    tokens = float(ds["data_traj_solver_frozen_checker_tokens_mean"].sel(policy="solver"))
    assert calls == 1.0  # one verdict per episode (no retry)
    assert 1.0 <= tokens <= 3.0  # its own max_new_tokens, whatever the run's
    assert ds.attrs["counter_data_frozen_checker_trajectories"] > 0  # its trajectories were counted ...
    assert ds.attrs["counter_data_frozen_checker_tokens"] > 0
    assert "data_groups_received" in ds and float(ds["data_groups_received"].sel(policy="solver")) > 0
    frozen = result.summary["frozen"]["checker"]
    assert frozen["calls_per_episode"] == 1.0 and frozen["episodes"] == frozen["calls"] > 0
    assert 0 < frozen["seconds_per_call"] < 60
    assert any(line.startswith("frozen model 'checker': ") and "per reply; never trained on" in line
               for line in lines), lines
    evals = ds["eval_accuracy"].values  # ... and the held-out evaluation ran with the frozen verifier too
    assert len(evals) >= 1
