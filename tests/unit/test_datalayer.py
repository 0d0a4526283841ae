"""DataLayer semantics: leases expire and are re-issued, admission is idempotent, staleness drops are counted."""

import pytest

from astratk.dataflow.datalayer import DataLayer
from astratk.records import Group, Trajectory, WeightRef
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(clock=None, **dataflow):
    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=2))],
                   dataflow=DataflowSpec(lease_timeout_s=10.0, **dataflow))
    return DataLayer(spec, clock=clock or Clock())


def group(lease, rewards=(1.0, 0.0), version=0):
    trajs = tuple(Trajectory(task_id=lease.task.task_id, group_id=f"{lease.lease_id}/{i}", policy_id="main",
                             role="policy", tokens=(1, 2, 3), n_prompt=2, loss_mask=(1,), behavior_logprobs=(-1.0,),
                             behavior_versions=(version,), reward=r) for i, r in enumerate(rewards))
    return Group(f"{lease.lease_id}/policy", lease.task, "main", trajs)


def test_lease_expires_and_is_reissued_with_same_id():
    clock = Clock()
    dl = make(clock)
    [a] = dl.lease(1)
    clock.now = 5.0
    [b] = dl.lease(1)
    assert b.lease_id != a.lease_id  # not expired yet: a fresh task
    clock.now = 10.5  # a's deadline (10.0) passed, b's (15.0) not
    [c] = dl.lease(1)
    assert (c.lease_id, c.task, c.attempt) == (a.lease_id, a.task, 2)
    assert c.deadline == pytest.approx(20.5)
    m = dl.metrics()
    assert m["data/leases_expired"] == 1 and m["data/leases_reissued"] == 1


def test_admission_is_idempotent_by_lease():
    clock = Clock()
    dl = make(clock)
    [a] = dl.lease(1)
    clock.now = 11.0
    [again] = dl.lease(1)  # re-issued: the slow original and the re-issue may both come back
    assert again.lease_id == a.lease_id
    assert dl.admit(a.lease_id, [group(a)]) == {"admitted": 1, "duplicate": 0}
    assert dl.admit(again.lease_id, [group(again)]) == {"admitted": 0, "duplicate": 1}
    assert dl.metrics()["data/duplicates_ignored"] == 1
    assert dl.metrics()["data/main/buffer_groups"] == 1


def test_failed_task_dropped_after_max_attempts():
    dl = make(max_task_attempts=2)
    [a] = dl.lease(1)
    dl.release([(a.lease_id, a.attempt)])
    [b] = dl.lease(1)
    assert b.lease_id == a.lease_id and b.attempt == 2
    dl.release([(b.lease_id, b.attempt)])
    [c] = dl.lease(1)
    assert c.lease_id != a.lease_id
    assert dl.metrics()["data/tasks_dropped_failed"] == 1


def test_dr_grpo_advantages_and_zero_variance_filter():
    dl = make()
    a, b = dl.lease(2)
    dl.admit(a.lease_id, [group(a, rewards=(1.0, 0.0, 0.0, 1.0))])
    dl.admit(b.lease_id, [group(b, rewards=(1.0, 1.0))])
    m = dl.metrics()
    assert m["data/main/groups_dropped_zero_variance"] == 1
    assert m["data/main/groups_admitted"] == 1
    [c] = dl.lease(1)
    dl.admit(c.lease_id, [group(c, rewards=(0.0, 1.0, 1.0, 1.0))])
    g1, g2 = dl.next_batch("main", 0)
    assert g1.advantages == (0.5, -0.5, -0.5, 0.5)  # R - mean(R), no std division
    assert g2.advantages == (-0.75, 0.25, 0.25, 0.25)


def test_staleness_drop_counted_and_bound_kept():
    dl = make(max_staleness=2)
    leases = dl.lease(3)
    for lease, v in zip(leases, (0, 1, 3)):
        dl.admit(lease.lease_id, [group(lease, version=v)])
    dl.publish_version(WeightRef("main", 3, "memory://x"))
    batch = dl.next_batch("main", 0)  # v0 is 3 behind (> 2): dropped; v1 (gap 2 = the bound) is kept
    assert [g.version for g in batch] == [1, 3]
    assert dl.metrics()["data/main/groups_dropped_stale"] == 1


def test_batch_assembled_once_and_sharded():
    dl = make()
    leases = dl.lease(4)
    for lease in leases:
        dl.admit(lease.lease_id, [group(lease)])
    full = dl.next_batch("main", 5, 0, 1)
    assert dl.next_batch("main", 5, 0, 1) == full  # a retry of the same step sees the same groups
    r0, r1 = dl.next_batch("main", 5, 0, 2), dl.next_batch("main", 5, 1, 2)
    assert r0 == [full[0]] and r1 == [full[1]]
    assert dl.next_batch("main", 6) is not None  # the other two groups
    assert dl.next_batch("main", 7) is None
    with pytest.raises(ValueError, match="rank"):
        dl.next_batch("main", 5, 2, 2)


def test_versions_never_go_back():
    dl = make()
    dl.publish_version(WeightRef("main", 2, "x"))
    with pytest.raises(ValueError, match="must not go back"):
        dl.publish_version(WeightRef("main", 1, "x"))


def test_failure_of_an_expired_attempt_leaves_its_reissue_running():
    clock = Clock()
    dl = make(clock)
    [a] = dl.lease(1)
    clock.now = 11.0
    [b] = dl.lease(1)  # a expired; b is its re-issue (attempt 2), still running
    assert (b.lease_id, b.attempt) == (a.lease_id, 2)
    dl.release([(a.lease_id, 1)])  # the stalled first attempt finally fails
    assert dl.metrics()["data/leases_outstanding"] == 1 and "data/leases_released_error" not in dl.metrics()
    assert dl.admit(b.lease_id, [group(b)]) == {"admitted": 1, "duplicate": 0}


def test_queued_reissue_is_dropped_once_the_original_is_admitted():
    clock = Clock()
    dl = make(clock, prefetch_steps=4)
    [a] = dl.lease(1)
    clock.now = 11.0
    assert dl.lease(0) == [] and dl.metrics()["data/leases_waiting_reissue"] == 1  # a expired, queued for re-issue
    dl.admit(a.lease_id, [group(a)])  # ...but its slow original comes back first
    [c] = dl.lease(1)
    assert c.lease_id != a.lease_id  # the pointless re-issue is skipped
    assert dl.metrics()["data/leases_waiting_reissue"] == 0


def test_trajectory_metrics_are_averaged_per_policy_and_role():
    import dataclasses

    dl = make()
    [lease] = dl.lease(1)
    g = group(lease)
    trajs = tuple(dataclasses.replace(t, metrics={"turns": float(i + 1), "code/tests_passed": 2.0})
                  for i, t in enumerate(g.trajectories))
    dl.admit(lease.lease_id, [dataclasses.replace(g, trajectories=trajs)])
    m = dl.metrics()
    role = trajs[0].role
    assert m[f"data/main/traj/{role}/turns_mean"] == 1.5
    assert m[f"data/main/traj/{role}/code_tests_passed_mean"] == 2.0
