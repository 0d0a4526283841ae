"""The notebook door: a run started in the background pauses (no new leases, no new batches: versions stand still),
resumes, and finishes without losing a group or training on one twice; its handle shows live status as HTML."""

from __future__ import annotations

import time

import pytest

from astratk.runtime.acquisition import task_accounting
from astratk.runtime.run import Run
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_background_run_pauses_resumes_and_loses_nothing(tmp_path):
    spec = small_spec(tmp_path, max_steps=8)
    spec.progress = False
    run = Run(spec, printer=lambda s: None)
    assert run.start(block=False) is run
    wait_until(lambda: run.status().get("main", {}).get("version", 0) >= 2, 240, "two trained steps")
    run.pause()
    assert run.state == "paused" and "paused" in run._repr_html_()
    def settled():  # the step in flight finishes and publishes; then nothing moves
        before = run.status()["main"]
        time.sleep(1.5)
        return before if run.status()["main"] == before else None

    frozen = wait_until(settled, 60, "the step in flight to finish after the pause")
    time.sleep(4.0)
    later = run.status()["main"]
    assert later["version"] == frozen["version"] and later["groups_served"] == frozen["groups_served"]
    run.resume()
    result = run.wait(timeout=300)
    assert result.summary["steps"] == 8 and result.summary["final_version"] == 8
    ids = run.session.group_ids["main"]
    assert len(ids) == 8 * spec.policies[0].trainer.groups_per_step and len(set(ids)) == len(ids)
    accounting = task_accounting(run.session.counters)
    assert accounting["tasks_lost"] <= 0
    assert run.state == "finished" and "accuracy" in run._repr_html_()
    with pytest.raises(RuntimeError, match="already started"):
        run.start()


def test_stop_finishes_the_current_step_and_writes_outputs(tmp_path):
    spec = small_spec(tmp_path, max_steps=500)
    spec.progress = False
    run = Run(spec, printer=lambda s: None)
    run.start(block=False)
    wait_until(lambda: run.status().get("main", {}).get("version", 0) >= 2, 240, "two trained steps")
    run.stop()
    result = run.wait(timeout=300)
    assert 2 <= result.summary["steps"] < 500 and result.files["metrics"].exists()
