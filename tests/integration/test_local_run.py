"""The real path on a real local Dask cluster (worker processes), with a small budget.

Checks that the whole data path runs (lease -> rollout -> score -> admit -> next_batch -> train -> publish -> sync),
that weight versions advance and reach the trajectories the trainer consumes, and that metrics and plots are written.
"""

from __future__ import annotations

import json

import pytest

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.losses.drpo import DRPO
from astratk.metrics import load
from astratk.runtime.run import Run
from astratk.spec import (
    ClusterSpec,
    DataflowSpec,
    EvalSpec,
    ModelSpec,
    PolicySpec,
    RolloutSpec,
    RunSpec,
    TinyModelSpec,
    TrainerSpec,
)

pytestmark = pytest.mark.integration


def small_spec(tmp_path, processes: bool = True, **trainer) -> RunSpec:
    tiny = TinyModelSpec(warm_start_steps=30, warm_start_batch=32)
    return RunSpec(
        name="it", output_dir=str(tmp_path / "runs"),
        env=ArithmeticEnv(levels=[1], n_heldout=32),
        policies=[PolicySpec(model=ModelSpec(tiny=tiny, cache_dir=str(tmp_path / "cache")), loss=DRPO(delta=0.5),
                             trainer=TrainerSpec(**{"max_steps": 6, "groups_per_step": 4, **trainer}))],
        rollout=RolloutSpec(group_size=4, max_new_tokens=6, tasks_per_chunk=4),
        dataflow=DataflowSpec(max_staleness=8, filter_zero_variance=False),
        cluster=ClusterSpec(rollout_workers=1, startup_timeout_s=120, processes=processes),
        eval=EvalSpec(interval_s=2.0, max_tasks=32, timeout_s=120),
    )


def test_local_run_advances_versions_and_writes_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRATK_DASHBOARD", "1")  # the suite skips the drawing elsewhere (tests/conftest.py)
    lines: list[str] = []
    result = Run(small_spec(tmp_path), printer=lines.append).start()
    s = result.summary
    assert s["steps"] == 6
    assert s["final_version"] == 6  # published every step
    ds = load(result.files["metrics"])
    assert list(ds.policy.values) == ["main"]
    assert ds.sizes["step"] == 6
    # versions reached the trajectories: later batches were sampled by published (v >= 1) weights
    assert float(ds["train_behavior_version_max"].max()) >= 1
    assert float(ds["train_policy_version"].sel(policy="main").isel(step=-1)) == 5  # the last step trained from v5, then published v6
    assert ds.sizes["evaluation"] >= 2 and float(ds["eval_version"].sel(policy="main").isel(evaluation=0)) == 0
    assert ds.attrs["partial"] == 0  # the final file (those written while training say 1)
    # |pi - mu| whatever the loss: the first step trains version 0 on version-0 rollouts (the mismatch alone: tiny)
    pi_mu = ds["train_pi_mu_abs_mean"].sel(policy="main").values
    assert pi_mu[0] < 1e-3 and (pi_mu >= 0).all()
    assert 0.0 <= s["accuracy_before"] <= 1.0 and 0.0 <= s["accuracy_after"] <= 1.0
    assert result.files["html"].stat().st_size > 10_000 and result.files["png"].stat().st_size > 5_000
    summary = json.loads(result.files["summary"].read_text())
    assert summary["final_version"] == 6
    assert any("held-out accuracy" in line for line in lines)
    # every sample is accounted for: admitted groups were served or are still buffered, or were counted as dropped
    assert float(ds["data_groups_admitted"].sel(policy="main")) >= 6 * 4


def test_threads_cluster_runs_the_same_path(tmp_path):
    """`cluster.processes: false` (the notebook/debugger mode) runs the same code path inside this process."""
    result = Run(small_spec(tmp_path, processes=False, max_steps=3), printer=lambda s: None).start()
    assert result.summary["steps"] == 3 and result.summary["final_version"] == 3
    assert "<table>" in result._repr_html_()


def test_weight_lag_forces_staleness_and_updates_per_batch_runs(tmp_path):
    """`rollout.weight_lag: 2`: once two versions exist, rollouts use newest - 2, so every later step trains on
    samples at least 2 versions old; with `trainer.updates_per_batch: 2` and decoupled PPO (which needs the proximal
    forward) through the real path."""
    from astratk.losses.decoupled_ppo import DecoupledPPO

    spec = small_spec(tmp_path, max_steps=10, updates_per_batch=2)
    spec.policies[0].loss = DecoupledPPO()
    spec.rollout.weight_lag = 2
    result = Run(spec.validate(), printer=lambda s: None).start()
    assert result.summary["steps"] == 10 and result.summary["final_version"] == 10
    ds = load(result.files["metrics"])
    version = ds["train_policy_version"].sel(policy="main").values
    newest_behaviour = ds["train_behavior_version_max"].sel(policy="main").values
    later = version >= 4  # by then version newest - 2 >= 2 had been published for a while
    assert later.any() and (version[later] - newest_behaviour[later] >= 2).all()
    assert (ds["train_updates"].sel(policy="main").values == 2).all()
    assert "loss_proximal_ratio_max" in ds and "loss_behavior_weight_max" in ds  # the loss got pi_prox (values:
    #   tests/unit/test_updates_per_batch.py; this tiny model earns no reward, so its weights do not move here)


def test_weight_lag_is_validated(tmp_path):
    spec = small_spec(tmp_path)
    spec.rollout.weight_lag = 9  # above max_staleness 8
    spec.weights.keep_last = 32  # so that the store's limit (checked first) is not what refuses it
    with pytest.raises(ValueError, match="staleness bound is 8"):
        spec.validate()
    spec.rollout.weight_lag, spec.dataflow.max_staleness, spec.weights.keep_last = 5, 8, 4
    with pytest.raises(ValueError, match="weights.keep_last is 4"):
        spec.validate()
    spec.rollout.weight_lag = -1
    with pytest.raises(ValueError, match="weight_lag must be an integer >= 0"):
        spec.validate()


@pytest.mark.parametrize("mode", ["inflight", "inflight_recompute"])
def test_inflight_weight_updates_run_through_the_config_keys(tmp_path, mode):
    """`rollout.weight_updates` reaches the rollout workers' engines and a watcher loads versions while chunks run."""
    spec = small_spec(tmp_path, processes=False, max_steps=4)
    spec.rollout.weight_updates = mode
    spec.rollout.weight_poll_s = 0.05
    result = Run(spec.validate(), printer=lambda s: None).start()
    assert result.summary["steps"] == 4 and result.summary["final_version"] == 4
    ds = result.metrics()
    assert float(ds["train_behavior_version_max"].max()) >= 1  # rollouts moved to newer versions during the run


def test_inflight_is_refused_in_the_synchronous_mode(tmp_path):
    spec = small_spec(tmp_path)
    spec.dataflow.synchronous, spec.rollout.weight_updates = True, "inflight"
    with pytest.raises(ValueError, match="synchronous trains step k on version k"):
        spec.validate()


def test_the_next_run_starts_on_the_cluster_the_last_one_kept_warm(tmp_path):
    """`cluster.keep_warm_s`: a run's local cluster serves the next run in the process with the same workers; the
    run's rollout services are released from the workers (their engines' memory) at its end; with 0 it is closed."""
    import dataclasses

    from astratk.rollout import services as svc
    from astratk.runtime import warm

    warm.close_kept()
    first: list[str] = []
    Run(small_spec(tmp_path, max_steps=2), printer=first.append).start()
    [(cluster, _, _)] = warm._kept.values()
    second: list[str] = []
    spec = small_spec(tmp_path, max_steps=2)
    spec.cluster = dataclasses.replace(spec.cluster, keep_warm_s=0)
    result = Run(spec, printer=second.append).start()
    assert result.summary["steps"] == 2
    assert any("local cluster kept for the next run" in line for line in first), first
    assert any("kept warm by the previous run" in line for line in second), second
    assert not any("kept warm by the previous run" in line for line in first)
    assert warm._kept == {} and cluster.status.name == "closed"  # keep_warm_s: 0 closed it at the end
    # the same, on a cluster kept alive: no service of an ended run stays in a worker
    Run(small_spec(tmp_path, max_steps=2), printer=lambda s: None).start()
    [(cluster, _, _)] = warm._kept.values()
    from distributed import Client

    with Client(cluster, set_as_default=False) as client:
        assert set(client.run(lambda: len(svc.SERVICES)).values()) == {0}
        # a run with another torch thread count takes it too, and its workers get its count, as fresh ones would
        spec = small_spec(tmp_path, max_steps=2)
        spec.cluster = dataclasses.replace(spec.cluster, torch_threads=2)
        third: list[str] = []
        Run(spec, printer=third.append).start()
        assert any("kept warm by the previous run" in line for line in third), third
        assert next(iter(warm._kept.values()))[0] is cluster

        def threads():
            import os

            import torch

            return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

        assert set(client.run(threads).values()) == {(2, "2")}
        assert set(client.run(lambda dask_worker: dask_worker.env["OMP_NUM_THREADS"], nanny=True).values()) == {"2"}
    assert warm.close_kept() == 1
