"""Elastic pools on a real cluster of worker processes: workers join and die during a run.

One run starts with one rollout worker. Once training is under way, a second worker joins the way a user adds one
(`dask worker --resources ...` in a subprocess) and a third through the cluster object (`cluster.scale_pool(2)`);
each must receive work, and its first trajectories must carry the version current when it started generating (it
catches up to the newest weights before its first generation), not the initial weights. Then rollout workers are
SIGKILLed at random while training runs (their nannies restart them). The run must finish every step with no task
lost and no group admitted twice, as the data layer's counters and its state show.

The tiny model generates a chunk in a few tens of milliseconds, so the pool would sit idle behind the trainer and a
kill would rarely hit a rollout in flight; every worker therefore simulates slower hardware (`slowdown`, see
`astratk.runtime.pools`), which keeps rollouts in flight throughout.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from astratk.runtime.acquisition import task_accounting
from astratk.runtime.pools import tls_environ
from astratk.runtime.session import Session
from astratk.spec import WorkerClass
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration

JOIN_TIMEOUT_S = 60.0  # generous: a joining worker imports torch and builds its engine before its first rollout
SLOWDOWN = 8.0
STEPS = 32


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(0.2)


def _rollout_workers(client) -> dict[str, str]:
    """name -> address of every live worker carrying the rollout label."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {str(w["name"]): a for a, w in workers.items() if w.get("resources", {}).get("rollout_main")}


def _start_dask_worker(address: str, name: str, tls: Any = None) -> subprocess.Popen:
    """A `dask worker` joining the run's local cluster, with the cluster's TLS credentials (`tls_environ`)."""
    dask_cli = Path(sys.executable).parent / "dask"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ASTRATK_WORKER_CLASS": "joined",
           "ASTRATK_SIM_SLOWDOWN": str(SLOWDOWN), **tls_environ(tls)}
    cmd = [str(dask_cli), "worker", address, "--name", name, "--nthreads", "1", "--host", "127.0.0.1",
           "--resources", "rollout_main=1,score=1", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Chaos:
    """Drives the run from a side thread: join two workers, wait until both produced data, then kill at random."""

    def __init__(self, session: Session, kills: int, seed: int = 0) -> None:
        self.session = session
        self.kills = kills
        self.rng = random.Random(seed)
        self.joined_at_version: int | None = None
        self.killed: list[tuple[str, int, float]] = []  # (worker, pid, when)
        self.dask_worker: subprocess.Popen | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def version(self) -> int:
        return int(self.session.deployment.datalayer.version("main"))

    def services(self) -> dict:
        return self.session.deployment.acquisition.services.by_service()

    def _run(self) -> None:
        try:
            s = self.session
            _wait(lambda: self.version() >= 2, 120, "training to publish version 2")
            self.joined_at_version = self.version()
            self.dask_worker = _start_dask_worker(s.client.scheduler.address, "joined-0", s.cluster.tls)
            s.cluster.scale_pool(2)  # adds rollout-1 through the cluster object
            _wait(lambda: {"joined-0", "rollout-1"} <= set(self.services()), JOIN_TIMEOUT_S,
                  "both joining workers to have rollouts admitted")
            for _ in range(self.kills):
                name, address = self.rng.choice(sorted(_rollout_workers(s.client).items()))
                pid = s.client.run(os.getpid, workers=[address])[address]
                os.kill(pid, signal.SIGKILL)
                self.killed.append((name, pid, time.monotonic()))
                time.sleep(self.rng.uniform(1.0, 3.0))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_workers_join_and_die_without_losing_or_duplicating_work(tmp_path):
    spec = small_spec(tmp_path, max_steps=STEPS)
    spec.cluster.pools = [WorkerClass("rollout", 1, slowdown=SLOWDOWN)]
    spec.dataflow.lease_timeout_s = 60.0  # longer than the run: a lost chunk comes back through Dask, not expiry
    spec.eval.interval_s = 60.0  # evaluations would compete for the few cores
    spec.eval.max_tasks = 8
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with Session(spec, run_dir, lambda line: None) as session:
        chaos = Chaos(session, kills=3, seed=2)  # seed 2 picks each of the three workers once when all are up
        chaos.thread.start()
        try:
            summary = session.train()
            trained_at = time.monotonic()
            chaos.thread.join(30)
            state = session.deployment.datalayer.state_dict()
        finally:
            if chaos.dask_worker is not None:
                chaos.dask_worker.terminate()
                chaos.dask_worker.wait(30)
    assert chaos.error is None, repr(chaos.error)
    counters, services = session.counters, session.service_rows

    # the run finished every step
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert len(chaos.killed) == 3 and all(when < trained_at for _, _, when in chaos.killed), chaos.killed

    # joining workers got work, and generated with the weights current when they started (not version 0)
    for name, hardware in (("joined-0", "joined"), ("rollout-1", "rollout")):
        row = services[name]
        assert row["tasks"] >= 1 and row["hardware"] == hardware, row
        assert row["first_version"] == row["first_synced_version"], row
        assert row["first_version"] >= chaos.joined_at_version >= 2, (row, chaos.joined_at_version)
        assert row["tasks_per_s"] > 0 and row["tokens_per_s"] > 0

    # no task lost: every lease id was admitted once, dropped (counted), or was still open when the run stopped
    acc = task_accounting(counters)
    assert counters.get("data/leases_expired", 0) == 0  # so the counter identity is exact (see task_accounting)
    assert acc["tasks_lost"] == 0, acc
    assert acc["tasks_completed"] >= STEPS * 4

    # no group admitted twice: one group per admitted lease (one role, no filters), and the groups the trainer was
    # served plus those still buffered are distinct
    received = counters["data/main/groups_received"]
    assert received == acc["tasks_completed"]
    assert counters["data/main/groups_admitted"] == received - counters.get("data/main/groups_dropped_empty", 0)
    served = [g.group_id for _, _, groups in state["serving"]["batches"] for g in groups]
    buffered = [g.group_id for g in state["serving"]["buffers"]["main"]]
    assert len(served) == STEPS * 4
    assert len(set(served + buffered)) == len(served + buffered)
    assert counters["data/main/groups_admitted"] == len(served) + len(buffered) + counters.get(
        "data/main/groups_dropped_stale", 0)
    # re-run chunks were recognised, not admitted (chains cancelled at shutdown are not collected, hence <=)
    assert counters.get("acquisition/main/duplicates", 0) <= counters.get("data/duplicates_ignored", 0)
    assert counters["acquisition/main/groups_admitted"] <= counters["data/main/groups_admitted"]


def test_autoscaler_resizes_the_rollout_pool_and_never_retires_the_data_layer(tmp_path):
    """The wait-fraction policy on a cluster of worker processes, fed trainer metrics directly: a starving trainer
    grows the pool to its maximum; a fed one shrinks it to its minimum; the control worker, and the data-layer actor
    on it, live through both."""
    from distributed import Client

    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer
    from astratk.runtime.autoscale import WaitFractionAdaptive, WaitFractionMonitor
    from astratk.runtime.pools import start_pool_cluster
    from astratk.spec import AutoscaleSpec, ClusterSpec, RunSpec

    scaling = AutoscaleSpec(minimum=1, maximum=3, cooldown_steps=0, wait_count=1, interval_s=0.5)
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, autoscale=scaling)).validate()
    cluster = start_pool_cluster(spec)
    try:
        with Client(cluster) as client:
            datalayer = DataLayerClient(client.submit(DataLayer, spec, actor=True, resources={"control": 1},
                                                      pure=False).result(60))
            [control] = [a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "control"]
            control_pid = client.run(os.getpid, workers=[control])[control]
            monitor = WaitFractionMonitor(scaling)
            adaptive = cluster.adapt(Adaptive=WaitFractionAdaptive, monitor=monitor)
            try:
                monitor.observe_step(wait_s=0.9, step_s=1.0)  # f = 0.9 -> ceil(1 / 0.1) = 10, capped at 3
                _wait(lambda: len(_rollout_workers(client)) == 3, 90, "the rollout pool to grow to 3 workers")
                monitor.wait_ewma = 0.0  # the trainer stopped waiting and used a tenth of the production
                monitor.observe_counts(consumed=10, produced=100)
                _wait(lambda: len(_rollout_workers(client)) == 1, 90, "the rollout pool to shrink to 1 worker")
            finally:
                adaptive.stop()
            assert client.run(os.getpid, workers=[control])[control] == control_pid
            assert datalayer.version("main") == 0  # the actor lives
            assert "control" in cluster.worker_spec and cluster.pool() == list(_rollout_workers(client))
            assert monitor.history[0]["target"] == 3  # the first decision went straight to the maximum
    finally:
        cluster.close()
