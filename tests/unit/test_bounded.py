"""Time bounds on user code: a hung call or episode is abandoned within its bound, named, and counted; a failed
attempt is released to the data layer for re-issue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from astratk.records import LeaseResult
from astratk.rollout import bounded
from astratk.rollout.bounded import BoundExceeded, bounded_episode, call_bounded, run_episodes
from astratk.rollout.tasks import admit_task


def test_call_bounded_returns_raises_and_abandons():
    assert call_bounded(lambda: 41 + 1, 5.0, "sum") == 42
    assert call_bounded(lambda: 7, None, "unbounded") == 7
    with pytest.raises(ZeroDivisionError):
        call_bounded(lambda: 1 / 0, 5.0, "division")
    before = bounded.abandoned_threads()
    release = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(BoundExceeded, match=r"scoring of task 't1' \(rollout.score_timeout_s\) did not finish "
                                            r"within 0.2s"):
        call_bounded(release.wait, 0.2, "scoring of task 't1' (rollout.score_timeout_s)")
    assert time.perf_counter() - t0 < 2.0 and bounded.abandoned_threads() == before + 1
    release.set()


def test_an_episode_stuck_in_a_blocking_step_is_abandoned_without_waiting_for_its_thread():
    """`asyncio.run` would wait at shutdown for the executor thread of the step the timeout gave up on (10 s here)."""
    release = threading.Event()

    async def episode():
        await asyncio.to_thread(release.wait, 10.0)  # a tool call that hangs
        return "done"

    t0 = time.perf_counter()
    with pytest.raises(BoundExceeded, match="an episode of task 'x'"):
        run_episodes(bounded_episode(episode(), 0.2, "an episode of task 'x'"))
    assert time.perf_counter() - t0 < 3.0
    release.set()
    assert run_episodes(bounded_episode(asyncio.sleep(0, "ok"), 5.0, "quick")) == "ok"


class _Layer:
    def __init__(self):
        self.released, self.admitted = [], []

    def release(self, leases, reason):
        self.released.append((sorted(leases), reason))

    def admit_many(self, items):
        from astratk.records import AdmitReport

        self.admitted.extend(items)
        return AdmitReport(outcomes=(), versions={})


def test_failed_attempts_are_released_for_reissue_and_counted():
    layer = _Layer()
    results = [LeaseResult("a", (), 1.0, "w", attempt=2, failure="episode_timeout"),
               LeaseResult("b", (), 1.0, "w", attempt=1, failure="score_timeout"),
               LeaseResult("c", (), 1.0, "w", attempt=1, failure="score_timeout")]
    out = admit_task(results, layer)
    assert sorted(layer.released) == [([("a", 2)], "episode_timeout"), ([("b", 1), ("c", 1)], "score_timeout")]
    assert layer.admitted == [] and out["episode_timeouts"] == 1.0 and out["score_timeouts"] == 2.0


@pytest.mark.parametrize("key", ["episode_timeout_s", "score_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0])
def test_timeouts_must_be_positive_or_null(key, value):
    from astratk.spec import RolloutSpec, RunSpec

    with pytest.raises(ValueError, match=rf"rollout.{key} must be > 0 seconds or null \(unbounded\), got {value}"):
        RunSpec(rollout=RolloutSpec(**{key: value})).validate()
    RunSpec(rollout=RolloutSpec(**{key: None})).validate()
