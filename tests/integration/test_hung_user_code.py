"""A reward function and an env step that hang, in a real run: each is abandoned at its bound, its task's attempt is
re-issued and, hanging again, dropped and counted; the run trains on the other tasks and finishes."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading

import pytest

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.runtime.run import Run
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration
_NEVER = threading.Event()


def _bucket(task_id: str) -> int:
    return int(hashlib.sha1(task_id.encode()).hexdigest(), 16) % 6


class HangingEnv(ArithmeticEnv):
    """One task in six hangs in its reward function, another in six in a tool step of its episode."""

    def score(self, task, trajectories):
        if _bucket(task.task_id) == 0 and task.split == "train":
            _NEVER.wait()  # a grader stuck for good
        return super().score(task, trajectories)

    async def rollout(self, task, engines, sampling, *, policy_ids, group_id):
        if _bucket(task.task_id) == 1 and task.split == "train":
            await asyncio.to_thread(_NEVER.wait)  # a tool call that never returns
        return await super().rollout(task, engines, sampling, policy_ids=policy_ids, group_id=group_id)


def test_hung_rewards_and_steps_are_bounded_counted_and_dropped(tmp_path):
    spec = small_spec(tmp_path, max_steps=4)
    spec.env = HangingEnv(levels=[1], n_heldout=16)
    spec.rollout = dataclasses.replace(spec.rollout, episode_timeout_s=1.0, score_timeout_s=1.0)
    spec.dataflow = dataclasses.replace(spec.dataflow, max_task_attempts=2)
    spec.eval = dataclasses.replace(spec.eval, interval_s=1e6, max_tasks=16)
    result = Run(spec, printer=lambda s: None).start()
    assert result.summary["steps"] == 4
    ds = result.metrics()
    counters = {k.removeprefix("counter_"): v for k, v in ds.attrs.items() if k.startswith("counter_")}
    timeouts = {k: v for k, v in counters.items() if "timeout" in k or "dropped" in k}
    assert float(ds["acquisition_score_timeouts"].sum()) >= 1, timeouts
    assert float(ds["acquisition_episode_timeouts"].sum()) >= 1, timeouts
    # each attempt released for re-issue, the task dropped (counted) once it failed max_task_attempts times
    assert counters["data_leases_released_score_timeout"] >= 1, timeouts
    assert counters["data_leases_released_episode_timeout"] >= 1, timeouts
    assert counters["data_tasks_dropped_failed"] >= 1, timeouts
