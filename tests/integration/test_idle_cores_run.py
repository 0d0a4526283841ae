"""A local run's waiting trainer lends its threads to the rollout worker on its host, and the metrics say how long
(`service_lent_s`); with `cluster.lend_idle_cores: false` nothing is lent."""

from __future__ import annotations

import contextlib
import os

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


@contextlib.contextmanager
def every_core():
    """The suite pins each test process to its share of the cores (tests/conftest.py); lending needs two: widen this
    process's set for the run (its workers are spawned, so they get the same), and put it back after."""
    pinned = os.sched_getaffinity(0)
    cores = os.environ.get("ASTRATK_TEST_CORES")
    wide = {int(c) for c in cores.split(",")} if cores else pinned
    if len(wide) < 2:
        pytest.skip("lending needs two cores")
    os.sched_setaffinity(0, wide)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def spec(tmp_path, lend: bool) -> RunSpec:
    tiny = TinyModelSpec(warm_start_steps=30, warm_start_batch=32)
    return RunSpec(
        name="lend", output_dir=str(tmp_path / "runs"), env=ArithmeticEnv(levels=[1], n_heldout=8),
        policies=[PolicySpec(model=ModelSpec(tiny=tiny, cache_dir=str(tmp_path / "cache")), loss=DRPO(delta=0.5),
                             trainer=TrainerSpec(max_steps=6, groups_per_step=16))],
        rollout=RolloutSpec(group_size=8, max_new_tokens=24, tasks_per_chunk=8),
        dataflow=DataflowSpec(filter_zero_variance=False),
        cluster=ClusterSpec(rollout_workers=1, startup_timeout_s=120, worker_start="spawn", keep_warm_s=0,
                            lend_idle_cores=lend),
        eval=EvalSpec(interval_s=1e6, max_tasks=8, timeout_s=120))


def test_a_waiting_trainer_lends_its_threads_and_the_metrics_say_how_long(tmp_path):
    with every_core():
        lines: list[str] = []
        lent = Run(spec(tmp_path / "on", lend=True), printer=lines.append).start()
        kept = Run(spec(tmp_path / "off", lend=False)).start()
    cpu = next(line for line in lines if line.startswith("CPU: torch threads"))
    assert "each rollout worker on its host runs 1 more (cluster.lend_idle_cores)" in cpu, cpu
    on = load(lent.files["metrics"])
    off = load(kept.files["metrics"])
    assert float(on["service_lent_s"].sum()) > 0  # the trainer waits for its first batch at least
    assert float(on["service_lent_s"].sum()) <= float(on["service_busy_s"].sum())
    assert float(off["service_lent_s"].sum()) == 0
