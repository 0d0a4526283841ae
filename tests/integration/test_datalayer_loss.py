"""Lose the data layer's worker mid-run (SIGKILL the control worker): its nanny restarts the process, the deployment
starts a replacement actor from the newest snapshot (one is written whenever a batch is served), and training
finishes every step without training on any group twice and without losing a task.

Training resumes as soon as the replacement exists: the handles that rollout chains carry to the workers move to
it (they used to wait for their 60 s call timeout on the dead actor: a 60 s stall), and the calls left hanging on the
dead actor print no traceback when the cluster shuts down."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from astratk.dataflow.client import DataLayerClient
from astratk.runtime.acquisition import task_accounting
from astratk.runtime.session import Session
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration

# The longest wait for a batch once the replacement actor is up: rollouts, one step, and slack for a loaded CI
# machine; a handle waiting out its 60 s call timeout on the dead actor makes it ~50 s.
RESUME_BOUND_S = 20.0


def control_pid(client) -> int:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    [addr] = [a for a, w in workers.items() if w.get("name") == "control"]
    return client.run(os.getpid, workers=[addr])[addr]


def test_lost_datalayer_worker_resumes_from_the_snapshot(tmp_path, capfd, monkeypatch):
    spec = small_spec(tmp_path, max_steps=10)
    spec.dataflow.lease_timeout_s = 30.0
    spec.progress = False
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed: dict[str, float] = {}
    batches: list[float] = []  # when the trainer got each batch
    next_batch = DataLayerClient.next_batch

    def timed_next_batch(self, *args, **kwargs):
        out = next_batch(self, *args, **kwargs)
        if out is not None:
            batches.append(time.time())
        return out

    monkeypatch.setattr(DataLayerClient, "next_batch", timed_next_batch)

    def killer(session: Session) -> None:
        deadline = time.monotonic() + 120
        # wait until training is under way, with rollouts in flight: their chains carry handles to this actor
        while time.monotonic() < deadline:
            m = session.deployment.datalayer.metrics()
            if m.get("data/main/groups_served", 0) >= 12 and m.get("data/leases_outstanding", 0) > 0:
                break
            time.sleep(0.05)
        pid = control_pid(session.client)
        killed["at"] = time.time()
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    with Session(spec, run_dir, lambda s: None) as session:
        handle = session.deployment.datalayer
        recover, replaced = handle.recover, []

        def timed_recover():
            actor = recover()
            replaced.append(time.time())
            return actor

        handle.recover = timed_recover
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
    # from the replacement on, the longest wait for a batch (the first may come from the snapshot's buffer)
    after = [t for t in batches if t > replaced[0]]
    assert after, "no batch after the replacement"
    stall = max(b - a for a, b in zip([replaced[0], *after], after))
    recovery = replaced[0] - killed["at"]
    err = capfd.readouterr().err
    with capfd.disabled():
        print(f"\ncontrol worker killed: replacement up after {recovery:.1f}s; then batches at most {stall:.1f}s "
              "apart")
    assert stall < RESUME_BOUND_S, (f"training stalled {stall:.0f}s after the replacement data layer started "
                                    f"(which took {recovery:.0f}s after the kill)")
    assert "Exception in callback" not in err, err[-3000:]  # calls left on the dead actor end quietly
