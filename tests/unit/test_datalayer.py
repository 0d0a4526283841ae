"""DataLayer semantics: leases expire and are re-issued, admission is idempotent, staleness drops are counted; stages
plug in at the three points, and the whole state round-trips."""

import pickle

import pytest

from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.stages import EDF, FIFO, GRESO, Curator, FilterSolved, LengthFilter, Mixing, Replay
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.mixture import MixtureEnv
from astratk.records import Group, Trajectory, WeightRef
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec
from astratk.training.collate import collate


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
    assert m["data/oldest_lease_s"] == pytest.approx(5.5)  # b, out since 5.0; the re-issued a counts from 10.5
    clock.now = 12.0
    assert dl.metrics()["data/oldest_lease_s"] == pytest.approx(7.0)


def test_admission_is_idempotent_by_lease():
    clock = Clock()
    dl = make(clock)
    [a] = dl.lease(1)
    clock.now = 11.0
    [again] = dl.lease(1)  # re-issued: the slow original and the re-issue may both come back
    assert again.lease_id == a.lease_id
    assert dl.admit(a.lease_id, [group(a)]).admitted == 1
    assert dl.admit(again.lease_id, [group(again)]).status == "duplicate"
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
    full = dl.next_batch("main", 2, 0, 1)  # step 2 trains from version 2: version-0 groups are within the bound 4
    assert dl.next_batch("main", 2, 0, 1) == full  # a retry of the same step sees the same groups
    r0, r1 = dl.next_batch("main", 2, 0, 2), dl.next_batch("main", 2, 1, 2)
    assert r0 == [full[0]] and r1 == [full[1]]
    assert dl.next_batch("main", 3) is not None  # the other two groups
    assert dl.next_batch("main", 4) is None
    with pytest.raises(ValueError, match="rank"):
        dl.next_batch("main", 2, 2, 2)


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
    assert dl.admit(b.lease_id, [group(b)]).admitted == 1


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


def test_leasing_stops_at_what_the_last_steps_need_and_a_longer_trainer_reopens_it():
    # max_steps 2 x 2 groups: 4 tasks in all, though the prefetch (4 steps) would allow 8
    spec = RunSpec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=2, max_steps=2))],
                   dataflow=DataflowSpec(lease_timeout_s=10.0, prefetch_steps=4))
    dl = DataLayer(spec, clock=Clock())
    first = dl.lease(8)
    assert len(first) == 4 and dl.lease(8) == []
    admit_all(dl, first[:1], rewards=(1.0, 1.0))  # a group without signal is dropped: its task is rolled out anew
    admit_all(dl, first[1:])
    [again] = dl.lease(8)
    admit_all(dl, [again])
    assert len(dl.next_batch("main", 0)) == 2 and dl.lease(8) == []  # step 1's two groups are buffered
    assert len(dl.next_batch("main", 1)) == 2 and dl.lease(8) == []
    # a trainer told to run longer (the Lightning CLI's --trainer.max_steps) asks for step 2: leasing resumes, and
    # stays open in a copy restored from the data layer's state
    assert dl.next_batch("main", 2) is None
    assert len(dl.lease(8)) == 8 and dl.metrics()["data/main/max_steps_lifted"] == 1
    restored = DataLayer(spec, clock=Clock())
    restored.load_state_dict(pickle.loads(pickle.dumps(dl.state_dict())))
    assert restored._server.wanted("main") == 8


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


# ------------------------------------------------------------------------------------------------------ stages
def admit_all(dl, leases, rewards=(1.0, 0.0), version=0):
    for lease in leases:
        dl.admit(lease.lease_id, [group(lease, rewards=rewards, version=version)])


class Recorder(Curator):
    """Refuses tasks whose prompt contains `refuse`; records every update and version change."""

    name = "recorder"

    def __init__(self, refuse="never"):
        self.refuse = refuse
        self.updates, self.versions = [], []

    def should_submit(self, task, version):
        return self.refuse not in task.prompt

    def update(self, task, rewards, version):
        self.updates.append((task.task_id, tuple(rewards), version))

    def on_version(self, version):
        self.versions.append(version)


class AcceptFirst(Curator):
    name = "first"

    def __init__(self, n):
        self.n = n

    def should_submit(self, task, version):
        self.n -= 1
        return self.n >= 0


def test_curators_skip_tasks_learn_at_admission_and_see_versions():
    dl = make(curators=[Recorder(refuse="+")], prefetch_steps=8)  # arithmetic levels 1-2: every prompt has '+'
    with pytest.raises(RuntimeError, match=r"refused 10000 tasks in a row .*max_curator_skips"):
        dl.lease(1)
    assert dl.metrics()["data/tasks_skipped_recorder"] == 10000
    dl = make(curators=[AcceptFirst(1)], max_curator_skips=3)
    assert len(dl.lease(2)) == 1  # the guard trips after one lease was built: that lease is handed out
    assert dl.metrics()["data/leases_outstanding"] == 1
    with pytest.raises(RuntimeError, match="refused 3 tasks in a row"):
        dl.lease(2)
    spec_curator = Recorder()
    dl = make(curators=[spec_curator, FilterSolved()])
    a, b = dl.lease(2)
    dl.admit(a.lease_id, [group(a, rewards=(1.0, 1.0), version=0)])  # dropped by zero variance...
    dl.admit(b.lease_id, [group(b, rewards=(1.0, 0.0), version=0)])
    rec = dl._curators["recorder"]
    assert rec.updates == [(a.task.task_id, (1.0, 1.0), 0), (b.task.task_id, (1.0, 0.0), 0)]  # ...but learnt from
    assert dl.metrics()["data/stage/filter_solved/tasks_tracked"] == 2
    dl.publish_version(WeightRef("main", 1, "x"))
    dl.publish_version(WeightRef("main", 1, "x"))  # same version again: not a change
    assert rec.versions == [1]
    assert spec_curator.updates == []  # the spec's stage is a template: the data layer works on a copy


def test_filters_drop_by_reason_and_zero_variance_can_be_turned_off():
    dl = make(filter_zero_variance=False, filters=[LengthFilter(max_tokens=0)])
    [a] = dl.lease(1)
    dl.admit(a.lease_id, [group(a, rewards=(1.0, 1.0))])
    assert dl.metrics()["data/main/groups_dropped_too_long"] == 1
    dl = make(filter_zero_variance=False)
    [a] = dl.lease(1)
    dl.admit(a.lease_id, [group(a, rewards=(1.0, 1.0))])
    assert dl.metrics()["data/main/groups_admitted"] == 1


def test_edf_serves_the_oldest_version_first():
    for order, want in ((FIFO(), [3, 1]), (EDF(), [1, 2])):
        dl = make(order=order)
        for lease, v in zip(dl.lease(3), (3, 1, 2)):
            dl.admit(lease.lease_id, [group(lease, version=v)])
        assert [g.version for g in dl.next_batch("main", 0)] == want


def test_replay_share_taken_first_and_counted():
    dl = make(replay=Replay(ratio=0.5), prefetch_steps=4)
    admit_all(dl, dl.lease(3))
    first = dl.next_batch("main", 0)  # replay empty: both fresh
    second = dl.next_batch("main", 1)  # 1 replayed (most recent served) + the third fresh group
    assert second[0] == first[1] and second[1] not in first
    m = dl.metrics()
    assert m["data/main/groups_replayed"] == 1 and m["data/main/groups_served"] == 4
    assert m["data/main/stage/replay/short"] == 1 and m["data/main/stage/replay/size"] == 3
    assert dl.next_batch("main", 2) is None  # needs one fresh group


def test_lag_decay_weights_reach_the_train_batch():
    dl = make(lag_decay=0.5)
    for lease, v in zip(dl.lease(2), (1, 2)):
        dl.admit(lease.lease_id, [group(lease, version=v)])
    dl.publish_version(WeightRef("main", 3, "x"))
    batch = dl.next_batch("main", 0)
    assert [g.weight for g in batch] == [0.25, 0.5]
    tb = collate(batch, pad_id=0)
    assert tb.weights[:, -1].tolist() == [0.25, 0.25, 0.5, 0.5]  # [B, T]: the completion position of each row


def mixture_spec(**dataflow):
    env = MixtureEnv({"a": ArithmeticEnv(levels=[1]), "b": ArithmeticEnv(levels=[2])})
    return RunSpec(env=env, policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=2))],
                   dataflow=DataflowSpec(lease_timeout_s=10.0, **dataflow))


def test_mixing_across_envs_fills_from_the_other_env_when_short():
    dl = DataLayer(mixture_spec(mixing=Mixing({"a": 1, "b": 1}), prefetch_steps=4), clock=Clock())
    leases = dl.lease(8)
    assert [lease.task.env for lease in leases] == ["a", "b"] * 4
    a_only = [lease for lease in leases if lease.task.env == "a"]
    admit_all(dl, a_only[:3])
    admit_all(dl, [leases[1]])  # one b
    assert [g.task.env for g in dl.next_batch("main", 0)] == ["a", "b"]
    assert [g.task.env for g in dl.next_batch("main", 1)] == ["a", "a"]  # b is short: filled from a
    m = dl.metrics()
    assert m["data/main/stage/mixing/short_b"] == 1 and m["data/main/stage/mixing/filled_from_a"] == 1


def test_state_dict_round_trip_continues_identically():
    clock = Clock()
    spec = mixture_spec(curators=[GRESO(seed=1), FilterSolved()], filters=[LengthFilter(max_tokens=5)],
                        order=EDF(), replay=Replay(ratio=0.5, selector="uniform"), mixing=Mixing({"a": 2, "b": 1}),
                        lag_decay=0.9, prefetch_steps=6)
    dl = DataLayer(spec, clock=clock)
    leases = dl.lease(8)
    for i, lease in enumerate(leases[:6]):
        dl.admit(lease.lease_id, [group(lease, rewards=(1.0, float(i % 2)), version=i % 3)])
    dl.publish_version(WeightRef("main", 2, "x"))
    dl.next_batch("main", 0)
    clock.now = 4.0
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    other = DataLayer(spec, clock=clock)
    other.load_state_dict(state)
    assert other.metrics() == dl.metrics()
    assert other.next_batch("main", 0) == dl.next_batch("main", 0)  # the cached batch
    for layer in (dl, other):
        layer.admit(leases[6].lease_id, [group(leases[6], rewards=(0.0, 1.0), version=2)])
    clock.now = 12.0  # leases[7] expired in both (restored deadline: 4 s now + 6 s it had left = 10)
    reissued = dl.lease(4)
    assert reissued == other.lease(4)
    assert (reissued[0].lease_id, reissued[0].attempt) == (leases[7].lease_id, 2) and len(reissued) == 4
    for step in (1, 2):
        batch = dl.next_batch("main", step)
        assert batch is not None and batch == other.next_batch("main", step)
    assert other.metrics() == dl.metrics() and dl.metrics()["data/main/groups_replayed"] == 2
    with pytest.raises(ValueError, match="curators"):
        DataLayer(mixture_spec(), clock=clock).load_state_dict(state)
