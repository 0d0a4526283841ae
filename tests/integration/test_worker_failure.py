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
