"""Kill the rollout worker mid-run (SIGKILL): its nanny restarts it, Dask reschedules its rollout, the new process
builds its service, catches up to the newest weights before generating, and training finishes every step."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from astratk.runtime.session import Session
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration


def rollout_worker(client) -> tuple[str, int]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    [addr] = [a for a, w in workers.items() if w.get("name") == "rollout-0"]
    return addr, client.run(os.getpid, workers=[addr])[addr]


def test_killed_rollout_worker_loses_no_step(tmp_path):
    spec = small_spec(tmp_path, max_steps=10)
    spec.dataflow.lease_timeout_s = 30.0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed: dict[str, int] = {}
    lines: list[str] = []

    def killer(session: Session) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until training is under way
            if session.deployment.datalayer.metrics().get("data/main/groups_served", 0) >= 8:
                break
            time.sleep(0.2)
        _, pid = rollout_worker(session.client)
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    with Session(spec, run_dir, lines.append) as session:
        thread = threading.Thread(target=killer, args=(session,), daemon=True)
        thread.start()
        summary = session.train()
        thread.join(5)
        _, new_pid = rollout_worker(session.client)
        counters = session.counters
    assert killed, "the worker was never killed"
    assert new_pid != killed["pid"]  # the nanny restarted it
    assert summary["steps"] == 10 and summary["final_version"] == 10
    rows = session.step_rows["main"]
    # after the restart the new process caught up: late batches carry versions far above 0
    assert max(r["train/main/behavior_version_max"] for r in rows[-3:]) >= 3
    assert counters["data/tasks_completed"] >= 10


def _back(client, name: str, old_pid: int, timeout: float = 120) -> int:
    """The pid of worker `name` once a process other than `old_pid` has joined under that name."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            workers = client.scheduler_info(n_workers=-1)["workers"]
            addrs = [a for a, w in workers.items() if w.get("name") == name]
            pid = client.run(os.getpid, workers=addrs)[addrs[0]] if addrs else None
        except OSError:  # the dead worker was still listed: its comm is closed
            pid = None
        if pid is not None and pid != old_pid:
            return pid
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for worker {name} to come back"
        time.sleep(0.3)


def test_a_slow_restart_keeps_the_worker_and_a_failed_one_starts_it_afresh(monkeypatch, caplog):
    """Dask's SpecCluster closes a lost worker's nanny for good when no worker of that name is back within
    `lost-worker-timeout` (15 s); a restart that imports torch on a busy 2-core machine took longer, and the pool
    lost the worker for the rest of the run. Here the timeout is shorter than any restart (0.2 s)."""
    import dask
    from distributed import Client

    from astratk.runtime import pools
    from astratk.spec import ClusterSpec, RunSpec

    monkeypatch.setattr(pools, "RESTART_PATIENCE", 10_000)
    # spawned: a worker forked from the fork server can be back within 0.2 s
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, worker_start="spawn")).validate()
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "0.2s"}):
        cluster = pools.start_pool_cluster(spec)
        try:
            with Client(cluster) as client:
                client.wait_for_workers(2, timeout=120)
                nanny = cluster.workers["rollout-0"]
                _, pid = rollout_worker(client)
                with caplog.at_level("WARNING", logger="astratk.runtime.pools"):
                    os.kill(pid, signal.SIGKILL)
                    pid = _back(client, "rollout-0", pid)
                assert cluster.workers["rollout-0"] is nanny  # the same nanny restarted it: nothing was closed
                assert "its nanny has been restarting it" in caplog.text

                # a nanny that cannot restart its worker is given up on: the worker is started afresh from the spec
                async def fail() -> None:
                    raise RuntimeError("simulated: the restart failed")

                monkeypatch.setattr(nanny, "instantiate", fail)
                monkeypatch.setattr(pools, "RESTART_PATIENCE", 3)
                with caplog.at_level("WARNING", logger="astratk.runtime.pools"):
                    os.kill(pid, signal.SIGKILL)
                    _back(client, "rollout-0", pid)
                # the cluster files its new nanny once the worker has joined the scheduler: a fork joins at once
                deadline = time.monotonic() + 30
                while cluster.workers.get("rollout-0") in (None, nanny):
                    assert time.monotonic() < deadline, "timed out after 30 s waiting for rollout-0's new nanny"
                    time.sleep(0.1)
                assert "did not come back" in caplog.text and "starting it afresh" in caplog.text
                assert set(cluster.workers) == {"control", "rollout-0"}
        finally:
            cluster.close()
