"""A run with a frozen model beside its policy: the solver trains, a frozen verifier (a tiny model of its own,
greedy) judges each answer in the episodes, and nothing it generates is trained on; its calls are counted."""

from __future__ import annotations

import dataclasses

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


def test_a_policy_trained_on_a_frozen_judge_is_measured_by_the_ground_truth(tmp_path):
    """A judge that says yes to everything (a scripted frozen model): the train reward is its verdict, 1 for every
    answer, while the metrics' ground truth and the held-out accuracy show how often the answers were right."""
    from astratk.envs.workflows import JudgedEnv
    from astratk.models import build_char_tokenizer

    tok = build_char_tokenizer()
    yes = [*tok("yes", add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids("<|im_end|>")]
    base = spec(tmp_path)
    run = dataclasses.replace(
        base, name="judged", env=JudgedEnv(ArithmeticEnv(levels=[1], n_heldout=8)),
        policies=[dataclasses.replace(base.policies[0], policy_id="main", roles=["policy"])],
        frozen=[FrozenSpec(name="judge", roles=["judge"], model=base.frozen[0].model, engine="scripted",
                           engine_args={"script": [yes]})])
    result = Run(run, printer=lambda line: None).start()
    ds = load(result.files["metrics"])
    traj = {k: float(ds[f"data_traj_policy_{k}_mean"].sel(policy="main"))
            for k in ("judge_verdict", "ground_truth", "judge_agrees", "judge_unparseable")}
    assert traj["judge_verdict"] == 1.0 and traj["judge_unparseable"] == 0.0
    assert traj["ground_truth"] < 1.0 and traj["judge_agrees"] == traj["ground_truth"]  # yes agrees only when right
    assert float(ds["data_reward_mean_received"].sel(policy="main")) == 1.0  # trained on the verdicts ...
    assert float(ds["eval_accuracy"].isel(evaluation=-1).max()) < 1.0  # ... measured on the held-out truth
    assert result.summary["frozen"]["judge"]["calls_per_episode"] == 1.0


def test_a_frozen_model_without_weights_stops_the_run_at_start_in_one_line(tmp_path):
    from transformers import Qwen2Config

    from astratk.models import build_char_tokenizer
    from astratk.models.tokenizer import save_char_tokenizer
    from astratk.spec import StartError

    empty = tmp_path / "checker"
    Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=128, vocab_size=300).save_pretrained(empty)
    save_char_tokenizer(build_char_tokenizer(), empty)
    base = spec(tmp_path)
    run = dataclasses.replace(base, frozen=[dataclasses.replace(base.frozen[0], model=ModelSpec(path=str(empty)))])
    lines: list[str] = []
    with pytest.raises(StartError, match=r"frozen\[0\]\.model\.path: .*checker' has no safetensors weights"):
        Run(run, printer=lines.append).start()
    assert not any(line.startswith("cluster up") for line in lines)  # refused before anything started


def test_a_killed_rollout_worker_comes_back_serving_the_frozen_model_too(tmp_path):
    """SIGKILL the rollout worker mid-run: its nanny restarts it, and the new process builds the frozen verifier's
    engine again from its model, as it does the policy's; every step still trains, every episode still calls it."""
    import os
    import signal
    import threading
    import time

    from astratk.runtime.session import Session
    from tests.integration.test_worker_failure import rollout_worker

    base = spec(tmp_path)
    run = dataclasses.replace(
        base, policies=[dataclasses.replace(base.policies[0], trainer=dataclasses.replace(
            base.policies[0].trainer, max_steps=8))],
        cluster=dataclasses.replace(base.cluster, processes=True, worker_start="spawn", keep_warm_s=0),
        dataflow=dataclasses.replace(base.dataflow, lease_timeout_s=30.0))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed: dict[str, float] = {}

    def killer(session: Session) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and session.deployment.datalayer.metrics().get(
                "data/solver/groups_served", 0) < 4:
            time.sleep(0.2)
        _, pid = rollout_worker(session.client)
        killed["episodes"] = session.deployment.datalayer.metrics().get("data/frozen/checker/episodes", 0.0)
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    with Session(run, run_dir, lambda line: None) as session:
        thread = threading.Thread(target=killer, args=(session,), daemon=True)
        thread.start()
        summary = session.train()
        thread.join(5)
        _, new_pid = rollout_worker(session.client)
        counters = session.counters
    assert "pid" in killed and new_pid != killed["pid"]
    assert summary["steps"] == 8 and summary["final_version"] == 8
    after = counters["data/frozen/checker/episodes"] - killed["episodes"]
    assert after > 0 and counters["data/frozen/checker/episode_calls"] == counters["data/frozen/checker/episodes"]
