"""Two background runs in one process (the notebook door, `Run(spec).start(block=False)` twice), training at the same
time: each finishes and writes its metrics and summary, and Dask's process-wide state is as it was.

The order is the one that lost the second run's outputs: the first run's client was opened first and closes first,
the second's closes last. Each run's client was the process's default, and a closing default client restores Dask's
scheduler setting to what it found, which for the second was the first's client, closed by then; the second run's
metrics save then raised "Requested dask.distributed scheduler but no Client active"."""

from __future__ import annotations

import json

import dask
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
from tests.integration.test_notebook_run import wait_until

pytestmark = pytest.mark.integration


def tiny_spec(tmp_path, name: str, max_steps: int) -> RunSpec:
    """The smallest real run (test_cli.py's budget); both runs share the model cache, built by the first."""
    tiny = TinyModelSpec(warm_start_steps=10, warm_start_batch=8, warm_start_target=None)
    return RunSpec(
        name=name, output_dir=str(tmp_path / "runs"), progress=False,
        env=ArithmeticEnv(levels=[1], n_heldout=16),
        policies=[PolicySpec(model=ModelSpec(tiny=tiny, cache_dir=str(tmp_path / "cache")), loss=DRPO(delta=0.2),
                             trainer=TrainerSpec(max_steps=max_steps, groups_per_step=2))],
        rollout=RolloutSpec(group_size=4, max_new_tokens=4, tasks_per_chunk=2),
        dataflow=DataflowSpec(filter_zero_variance=False),
        cluster=ClusterSpec(rollout_workers=1, startup_timeout_s=120),
        eval=EvalSpec(interval_s=30.0, max_tasks=16, timeout_s=120),
    )


def version(run: Run) -> int:
    return int(run.status().get("main", {}).get("version", 0))


def test_two_background_runs_in_one_process_both_write_their_outputs(tmp_path):
    before = dask.config.get("scheduler", None)
    first = Run(tiny_spec(tmp_path, "first", max_steps=4), printer=lambda s: None).start(block=False)
    wait_until(lambda: version(first) >= 1, 240, "the first run's first step")
    first.pause()  # up, with its client, until the second trains too
    # more steps than a tiny run makes between two polls of `wait_until` (a poll is a data-layer round trip, which
    # took seconds under the full suite's load: 40 steps once finished before the pause), so the pause lands mid-run
    second = Run(tiny_spec(tmp_path, "second", max_steps=120), printer=lambda s: None).start(block=False)
    wait_until(lambda: version(second) >= 1, 240, "the second run's first step")
    assert first.state == "paused" and second.state == "training"
    second.pause()  # the first finishes (and closes its client) while the second is still up
    first.resume()
    results = [first.wait(timeout=240)]
    assert second.state == "paused"
    second.resume()
    results.append(second.wait(timeout=240))
    for result, name, steps in zip(results, ("first", "second"), (4, 120)):
        assert result.summary["steps"] == steps and result.summary["final_version"] == steps, name
        assert load(result.files["metrics"]).sizes["step"] == steps, name
        assert json.loads(result.files["summary"].read_text())["final_version"] == steps, name
    assert results[0].run_dir != results[1].run_dir
    assert dask.config.get("scheduler", None) == before
