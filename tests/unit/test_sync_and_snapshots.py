"""Synchronous rounds, per-policy staleness, the version barrier, batched admission, data-layer snapshots (store,
checkpoint pairing, corruption) and restore (no lease lost, none admitted twice), and the weight store's rollback."""

from __future__ import annotations

import pickle

import pytest
import torch

from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.snapshots import SnapshotStore
from astratk.envs.workflows.solver_verifier import SolverVerifierEnv
from astratk.records import AdmitOutcome, AdmitReport, Group, Trajectory, WeightRef
from astratk.spec import ClusterSpec, DataflowSpec, PolicySpec, RunSpec, SnapshotSpec, TrainerSpec
from astratk.weights.store import WeightStore
from tests.unit.test_datalayer import Clock


def spec(policies=None, **dataflow) -> RunSpec:
    return RunSpec(policies=policies or [PolicySpec(trainer=TrainerSpec(groups_per_step=2))],
                   dataflow=DataflowSpec(lease_timeout_s=10.0, **dataflow))


def group(lease, rewards=(1.0, 0.0), version=0, policy="main", role="policy"):
    trajs = tuple(Trajectory(task_id=lease.task.task_id, group_id=f"{lease.lease_id}/{i}", policy_id=policy,
                             role=role, tokens=(1, 2, 3), n_prompt=2, loss_mask=(1,), behavior_logprobs=(-1.0,),
                             behavior_versions=(version,), reward=r) for i, r in enumerate(rewards))
    return Group(f"{lease.lease_id}/{role}", lease.task, policy, trajs)


def ref(version, policy="main"):
    return WeightRef(policy_id=policy, version=version, uri="memory://x", kind="full")


# ------------------------------------------------------------------------------------------------- synchronous
def test_synchronous_rounds_wait_for_the_trainer_and_admit_in_lease_order():
    dl = DataLayer(spec(synchronous=True), clock=Clock())
    round0 = dl.lease(100)  # a whole round whatever is asked: exactly one step's worth
    assert [lease.lease_id for lease in round0] == ["L0", "L1"]
    assert dl.lease(100) == []  # nothing more while the round is out
    assert dl.admit("L1", [group(round0[1])]).admitted == 0  # held until the round is complete...
    assert dl.next_batch("main", 0) is None
    assert dl.admit("L0", [group(round0[0])]).admitted == 2  # ...then admitted in lease order
    assert [g.group_id for g in dl.next_batch("main", 0)] == ["L0/policy", "L1/policy"]
    assert dl.lease(100) == []  # step 0 served: no rollouts until its weights (version 1) are published
    assert dl.next_batch("main", 1) is None
    dl.publish_version(ref(1))
    assert [lease.lease_id for lease in dl.lease(1)] == ["L2", "L3"]


def test_synchronous_rounds_refill_what_filters_drop_and_staleness_is_zero():
    dl = DataLayer(spec(synchronous=True, max_staleness=4), clock=Clock())
    a, b = dl.lease(8)
    dl.admit_many([(a.lease_id, [group(a, rewards=(1.0, 1.0))]), (b.lease_id, [group(b)])])  # a: zero variance
    more = dl.lease(8)  # 1 short; half the tasks kept a group, so 2 are leased
    assert [lease.lease_id for lease in more] == ["L2", "L3"]
    dl.admit_many([(x.lease_id, [group(x)]) for x in more])
    assert len(dl.next_batch("main", 0)) == 2
    m = dl.metrics()
    assert m["data/main/groups_dropped_zero_variance"] == 1 and m["data/main/buffer_groups"] == 1
    dl.publish_version(ref(1))
    dl.lease(8)  # the left-over version-0 group is stale at version 1 (max_staleness is 0 in this mode)
    assert dl.metrics()["data/main/groups_dropped_stale"] == 1


def test_synchronous_round_completes_when_a_task_is_dropped_after_failures():
    dl = DataLayer(spec(synchronous=True, max_task_attempts=1), clock=Clock())
    a, b = dl.lease(8)
    dl.admit(b.lease_id, [group(b)])
    dl.release([(a.lease_id, a.attempt)])  # dropped (1 attempt allowed): the round is complete without it
    assert dl.metrics()["data/main/buffer_groups"] == 1 and dl.metrics()["data/tasks_dropped_failed"] == 1


def test_synchronous_mode_needs_one_rollout_worker_and_publishing_every_step():
    with pytest.raises(ValueError, match="one rollout worker"):
        RunSpec(dataflow=DataflowSpec(synchronous=True), cluster=ClusterSpec(rollout_workers=2)).validate()
    with pytest.raises(ValueError, match="publish_every"):
        RunSpec(dataflow=DataflowSpec(synchronous=True),
                policies=[PolicySpec(trainer=TrainerSpec(publish_every=2))]).validate()


# ------------------------------------------------------------------------------------------------ multi-policy
def two_policies(solver_staleness=None, **dataflow) -> RunSpec:
    solver = TrainerSpec(groups_per_step=1, max_staleness=solver_staleness)
    return RunSpec(env=SolverVerifierEnv(), dataflow=DataflowSpec(lease_timeout_s=10.0, **dataflow), policies=[
        PolicySpec("solver", roles=["solver"], trainer=solver),
        PolicySpec("verifier", roles=["verifier"], trainer=TrainerSpec(groups_per_step=1))]).validate()


def test_each_policy_has_its_own_staleness_bound():
    dl = DataLayer(two_policies(solver_staleness=0, max_staleness=3), clock=Clock())
    leases = dl.lease(2)
    for lease in leases:
        dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver"),
                                  group(lease, policy="verifier", role="verifier")])
    dl.publish_version(ref(1, "solver"))
    dl.publish_version(ref(1, "verifier"))
    assert dl.next_batch("solver", 0) is None  # solver: max_staleness 0, its version-0 groups are stale
    assert dl.next_batch("verifier", 0) is not None  # verifier: dataflow.max_staleness 3
    m = dl.metrics()
    assert m["data/solver/groups_dropped_stale"] == 2 and m.get("data/verifier/groups_dropped_stale", 0) == 0


def test_version_barrier_keeps_policies_in_lock_step():
    dl = DataLayer(two_policies(version_barrier=0), clock=Clock())
    leases = dl.lease(4)
    for lease in leases:
        dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver"),
                                  group(lease, policy="verifier", role="verifier")])
    assert dl.next_batch("solver", 0) is not None
    dl.publish_version(ref(1, "solver"))
    assert dl.next_batch("solver", 1) is None  # the verifier is still at version 0
    assert dl.metrics()["data/solver/barrier_waits"] == 1
    assert dl.next_batch("verifier", 0) is not None
    dl.publish_version(ref(1, "verifier"))
    assert dl.next_batch("solver", 1) is not None


def test_admit_many_is_admit_for_each_lease_plus_versions():
    dl = DataLayer(spec(), clock=Clock())
    a, b = dl.lease(2)
    out = dl.admit_many([(a.lease_id, [group(a)]), (b.lease_id, [group(b)]), (a.lease_id, [group(a)])])
    assert out == AdmitReport((AdmitOutcome(a.lease_id, "new", 1), AdmitOutcome(b.lease_id, "new", 1),
                               AdmitOutcome(a.lease_id, "duplicate", 0)), {"main": 0})
    assert (out.admitted, out.duplicates) == (2, 1)


# --------------------------------------------------------------------------------------------------- snapshots
def test_snapshot_store_keeps_checkpoints_prunes_periodic_and_refuses_corrupt_bytes(tmp_path):
    store = SnapshotStore(str(tmp_path / "snaps"), keep_last=2)
    ckpt = store.write({"x": 0}, kind="checkpoint", versions={"main": 2}, served={"main": 2})
    for i in range(4):
        store.write({"x": i + 1}, kind="periodic", versions={"main": 2 + i}, served={"main": 3 + i})
    assert [e.kind for e in store.entries()] == ["checkpoint", "periodic", "periodic"]
    assert sorted(p.name for p in (tmp_path / "snaps").glob("*.pkl")) == [
        "snap-00000000.pkl", "snap-00000003.pkl", "snap-00000004.pkl"]
    assert store.at_checkpoint("main", 2) == ckpt
    with pytest.raises(FileNotFoundError, match="checkpoint at step 4; checkpoint snapshots exist for versions"
                                                r" \[2\]"):
        store.at_checkpoint("main", 4)
    newest = store.latest()
    assert store.read(newest) == {"x": 4}
    (tmp_path / "snaps" / newest.name).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        store.read(newest)
    assert store.read(store.latest()) == {"x": 3}  # latest() skips the corrupt one


def test_datalayer_writes_snapshots_at_checkpoint_versions_and_served_steps(tmp_path):
    url = str(tmp_path / "dl")
    s = spec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=1, checkpoint_every=2))],
             snapshot=SnapshotSpec(every_steps=2))
    dl = DataLayer(s, clock=Clock(), snapshot_url=url)
    for step in range(4):
        [lease] = dl.lease(1)
        dl.admit(lease.lease_id, [group(lease, version=step)])
        dl.next_batch("main", step)
        dl.publish_version(ref(step + 1))
    kinds = [(e.kind, e.versions["main"], e.served["main"]) for e in SnapshotStore(url).entries()]
    assert kinds == [("periodic", 1, 2), ("checkpoint", 2, 2), ("periodic", 3, 4), ("checkpoint", 4, 4)]
    assert dl.metrics()["data/snapshots_checkpoint"] == 2
    with pytest.raises(RuntimeError, match="no snapshot store"):
        DataLayer(spec(), clock=Clock()).snapshot()


def test_restore_reissues_outstanding_leases_and_admits_nothing_twice(tmp_path):
    clock = Clock()
    url = str(tmp_path / "dl")
    s = spec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=4))])
    dl = DataLayer(s, clock=clock, snapshot_url=url)
    a, b, c = dl.lease(3)
    dl.admit(a.lease_id, [group(a)])
    dl.snapshot()
    dl.admit(b.lease_id, [group(b)])  # after the snapshot: lost with the layer
    state = SnapshotStore(url).read(SnapshotStore(url).latest())
    new = DataLayer.restore(s, pickle.loads(pickle.dumps(state)), clock=clock)
    again = new.lease(10)
    assert [(x.lease_id, x.attempt) for x in again[:2]] == [("L1", 1), ("L2", 1)]  # at once, same ids and attempts
    assert [x.task for x in again[:2]] == [b.task, c.task]
    assert new.admit(a.lease_id, [group(a)]).status == "duplicate"  # admitted before the snapshot
    assert new.admit(b.lease_id, [group(b)]).admitted == 1
    assert again[2].lease_id == "L3" and again[2].task == dl.lease(1)[0].task  # the task stream continues in step
    m = new.metrics()
    assert m["data/leases_restored"] == 2 and m["data/restores"] == 1


def test_datalayer_state_refuses_another_format():
    dl = DataLayer(spec(), clock=Clock())
    state = dl.state_dict()
    state["format"] = 1
    with pytest.raises(ValueError, match="format 1"):
        dl.load_state_dict(state)


# ------------------------------------------------------------------------------------------------ weight store
def test_weight_store_rollback_forgets_later_versions(tmp_path):
    store = WeightStore(str(tmp_path / "w"), full_every=2)
    states = [{"w": torch.full((4,), float(v))} for v in range(4)]
    for v, st in enumerate(states):
        store.publish("main", v, st)
    assert store.rollback("main", 1).version == 1
    assert store.latest("main").version == 1
    with pytest.raises(KeyError):
        store.ref("main", 3)
    payload, r = store.pull("main", None, None)
    assert r.version == 1 and torch.equal(payload["w"], states[1]["w"])
    store.publish("main", 2, {"w": torch.full((4,), 7.0)})  # a resumed trainer publishes from there
    assert torch.equal(store.pull("main", None, 2)[0]["w"], torch.full((4,), 7.0))
    with pytest.raises(KeyError, match="version 9"):
        store.rollback("main", 9)


def test_episode_seeds_are_per_lease_and_episode_and_stable():
    from astratk.rollout.service import episode_seed

    seeds = {episode_seed(0, f"L{i}", j) for i in range(50) for j in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**62 for s in seeds)
    assert episode_seed(0, "L3", 1) == episode_seed(0, "L3", 1) != episode_seed(1, "L3", 1)


def test_synchronous_multi_policy_rounds_train_one_policy_after_the_other():
    s = two_policies(synchronous=True)
    s.cluster.rollout_workers = 1
    dl = DataLayer(s, clock=Clock())
    [lease] = dl.lease(10)
    dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver"),
                              group(lease, policy="verifier", role="verifier")])
    assert dl.next_batch("verifier", 0) is None  # the solver trains first
    assert dl.next_batch("solver", 0) is not None
    assert dl.next_batch("verifier", 0) is None and dl.lease(10) == []
    dl.publish_version(ref(1, "solver"))
    assert dl.next_batch("verifier", 0) is not None and dl.lease(10) == []  # next round after both published
    dl.publish_version(ref(1, "verifier"))
    assert len(dl.lease(10)) == 1


def test_a_policy_held_by_the_barrier_does_not_starve_the_other():
    """The verifier is ahead and held by the barrier; its buffer is full. Leasing must go on for the solver (a
    minimum over policies would deadlock: the verifier waits for the solver, the solver for data), and the
    verifier's surplus is capped (oldest dropped, counted)."""
    dl = DataLayer(two_policies(version_barrier=0, prefetch_steps=2.0), clock=Clock())
    for _ in range(2):
        for lease in dl.lease(1):
            dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver"),
                                      group(lease, policy="verifier", role="verifier")])
    assert dl.next_batch("solver", 0) is not None  # the solver trains step 0: its buffer is empty again
    dl.publish_version(ref(1, "solver"))
    assert dl.next_batch("solver", 1) is None  # held: the verifier (version 0) has not trained step 0 yet
    assert dl.metrics()["data/verifier/buffer_groups"] == 2  # full for the verifier (target 2)...
    assert len(dl.lease(1)) == 1  # ...and yet the solver still gets tasks
    for _ in range(20):
        for lease in dl.lease(1):
            dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver"),
                                      group(lease, policy="verifier", role="verifier")])
        dl._server._buffers["solver"].clear()  # the solver keeps consuming
    m = dl.metrics()
    assert m["data/verifier/buffer_groups"] <= 8 + 1 and m["data/verifier/groups_dropped_overflow"] > 0  # cap + in flight
    assert dl.next_batch("verifier", 0) is not None  # the verifier catches up from its freshest groups


def test_restored_leases_are_reissued_even_when_they_fill_the_prefetch_room(tmp_path):
    """A snapshot with a full prefetch window of leases out (8 = 2 steps x 4 groups): after restore they wait for
    re-issue, and the room for new tasks is 0; re-issues must still go out (else the run waits forever)."""
    s = spec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=4))])
    dl = DataLayer(s, clock=Clock(), snapshot_url=str(tmp_path / "dl"))
    assert len(dl.lease(100)) == 8
    new = DataLayer.restore(s, dl.state_dict(), clock=Clock())
    again = new.lease(100)
    assert [x.lease_id for x in again] == [f"L{i}" for i in range(8)]
    assert new.lease(100) == []  # and nothing new beyond the window


def test_checkpoint_time_used_reads_the_timer_state(tmp_path):
    import torch

    from astratk.runtime.resume import checkpoint_time_used

    path = tmp_path / "step=3.ckpt"
    torch.save({"callbacks": {"Timer": {"time_elapsed": {"train": 42.5, "validate": 0.0}}}, "state_dict": {}}, path)
    assert checkpoint_time_used(path) == 42.5
    torch.save({"callbacks": {}}, path)
    assert checkpoint_time_used(path) == 0.0


def test_prune_checkpoints_keeps_the_newest(tmp_path):
    from types import SimpleNamespace

    from astratk.training.build import PruneCheckpoints

    for step in (2, 10, 4, 8, 6):
        (tmp_path / f"step={step}.ckpt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("kept")
    trainer = SimpleNamespace(global_rank=0, checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path))])
    PruneCheckpoints(2).on_train_end(trainer, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step=10.ckpt", "step=8.ckpt"]
    PruneCheckpoints(1).on_train_batch_end(SimpleNamespace(global_rank=1, checkpoint_callbacks=trainer
                                                           .checkpoint_callbacks))  # not rank 0: nothing
    assert len(list(tmp_path.glob("*.ckpt"))) == 2
