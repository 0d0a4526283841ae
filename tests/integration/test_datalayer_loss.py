"""Lose the data layer's worker mid-run (SIGKILL the control worker): its nanny restarts the process, the deployment
starts a replacement actor from the newest snapshot (one is written whenever a batch is served), and training
finishes every step without training on any group twice and without losing a task."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from astratk.runtime.acquisition import task_accounting
from astratk.runtime.session import Session
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration


def control_pid(client) -> int:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    [addr] = [a for a, w in workers.items() if w.get("name") == "control"]
    return client.run(os.getpid, workers=[addr])[addr]


def test_lost_datalayer_worker_resumes_from_the_snapshot(tmp_path):
    spec = small_spec(tmp_path, max_steps=10)
    spec.dataflow.lease_timeout_s = 30.0
    spec.progress = False
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed: dict[str, int] = {}

    def killer(session: Session) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until training is under way
            if session.deployment.datalayer.metrics().get("data/main/groups_served", 0) >= 12:
                break
            time.sleep(0.2)
        pid = control_pid(session.client)
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    with Session(spec, run_dir, lambda s: None) as session:
        thread = threading.Thread(target=killer, args=(session,), daemon=True)
        thread.start()
        summary = session.train()
        thread.join(5)
        recoveries = session.deployment.datalayer.recoveries
        new_pid = control_pid(session.client)
        ids = session.stream.group_ids
    assert killed, "the control worker was never killed"
    assert new_pid != killed["pid"] and recoveries == 1
    assert summary["steps"] == 10 and summary["final_version"] == 10
    assert len(ids) == 10 * spec.policies[0].trainer.groups_per_step and len(set(ids)) == len(ids)
    counters = session.counters
    assert counters["data/restores"] == 1 and counters["data/snapshots_periodic"] >= 10
    accounting = task_accounting(counters)
    assert accounting["tasks_lost"] <= 0 and -accounting["tasks_lost"] <= counters.get("data/leases_expired", 0)
