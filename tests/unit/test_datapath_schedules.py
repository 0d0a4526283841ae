"""Schedules the data layer once got wrong, each as it was reported: a version barrier with
`publish_every >= 2` (deadlock), a result arriving after its lease was dropped (lost as a
duplicate), a data-parallel rank asking for step k before rank 0 published (staleness bound broken
by one), a replayed group older than the bound."""

from __future__ import annotations

from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.stages import Replay
from astratk.runtime.acquisition import task_accounting
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec
from tests.unit.test_datalayer import Clock
from tests.unit.test_sync_and_snapshots import group, ref


def _two_policies(publish_every: int, max_steps: int, **dataflow) -> RunSpec:
    from astratk.envs.workflows.solver_verifier import SolverVerifierEnv

    def trainer() -> TrainerSpec:
        return TrainerSpec(groups_per_step=1, publish_every=publish_every, max_steps=max_steps)

    return RunSpec(env=SolverVerifierEnv(), dataflow=DataflowSpec(lease_timeout_s=10.0, **dataflow),
                   policies=[PolicySpec("solver", roles=["solver"], trainer=trainer()),
                             PolicySpec("verifier", roles=["verifier"], trainer=trainer())])


def _drive(dl: DataLayer, policies: dict[str, int], publish_every: int, max_steps: int,
           rounds: int = 500) -> dict:
    """Trainers that keep asking (each its own step counter), with rollouts arriving as leases
    allow; returns the steps each reached."""
    step = dict.fromkeys(policies, 0)
    for _ in range(rounds):
        for lease in dl.lease(2):
            dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver",
                                            version=dl.version("solver")),
                                      group(lease, policy="verifier", role="verifier",
                                            version=dl.version("verifier"))])
        for pid in policies:
            if step[pid] < max_steps and dl.next_batch(pid, step[pid]) is not None:
                step[pid] += 1
                if step[pid] % publish_every == 0:
                    dl.publish_version(ref(step[pid] // publish_every, pid))
        if all(s == max_steps for s in step.values()):
            break
    return step


def test_version_barrier_with_publish_every_two_trains_both_policies_to_max_steps():
    spec = _two_policies(publish_every=2, max_steps=12, version_barrier=0)
    spec.validate()
    dl = DataLayer(spec, clock=Clock())
    assert (_drive(dl, {"solver": 0, "verifier": 0}, publish_every=2, max_steps=12)
            == {"solver": 12, "verifier": 12})


def test_version_barrier_still_pairs_versions_with_publish_every_two():
    """Barrier 0: the solver may not train from version v + 1 while the verifier has not
    published v + 1."""
    dl = DataLayer(_two_policies(publish_every=2, max_steps=12, version_barrier=0,
                                 prefetch_steps=4.0),
                   clock=Clock())
    for lease in dl.lease(4):
        dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver"),
                                  group(lease, policy="verifier", role="verifier")])
    assert dl.next_batch("solver", 0) is not None and dl.next_batch("solver", 1) is not None
    dl.publish_version(ref(1, "solver"))
    # step 2 trains from version 1; the verifier is at 0
    assert dl.next_batch("solver", 2) is None
    assert dl.next_batch("verifier", 0) is not None and dl.next_batch("verifier", 1) is not None
    dl.publish_version(ref(1, "verifier"))
    assert dl.next_batch("solver", 2) is not None


def test_a_finished_policy_does_not_hold_the_other_at_the_barrier():
    spec = _two_policies(publish_every=1, max_steps=3, version_barrier=0)
    # the solver trains longer than the verifier
    spec.policies[0].trainer.max_steps = 6
    dl = DataLayer(spec, clock=Clock())
    step = {"solver": 0, "verifier": 0}
    for _ in range(200):
        for lease in dl.lease(2):
            dl.admit(lease.lease_id, [group(lease, policy="solver", role="solver",
                                            version=dl.version("solver")),
                                      group(lease, policy="verifier", role="verifier",
                                            version=dl.version("verifier"))])
        for pid, last in (("solver", 6), ("verifier", 3)):
            if step[pid] < last and dl.next_batch(pid, step[pid]) is not None:
                step[pid] += 1
                dl.publish_version(ref(step[pid], pid))
    assert step == {"solver": 6, "verifier": 3}


def test_result_of_a_lease_dropped_after_its_last_attempt_is_admitted_not_a_duplicate():
    """Lease timeout 10 s, 2 attempts: leased at t = 0 and 11, dropped at 22; then the first
    rollout's result."""
    clock = Clock()
    dl = DataLayer(RunSpec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=2))],
                           dataflow=DataflowSpec(lease_timeout_s=10.0, max_task_attempts=2)),
                   clock=clock)
    [first] = dl.lease(1)
    clock.now = 11.0
    [again] = dl.lease(1)
    assert (again.lease_id, again.attempt) == (first.lease_id, 2)
    clock.now = 22.0
    [other] = dl.lease(1)
    assert other.lease_id != first.lease_id and dl.metrics()["data/tasks_dropped_failed"] == 1
    out = dl.admit(first.lease_id, [group(first)])
    assert (out.status, out.admitted) == ("late", 1)
    m = dl.metrics()
    assert m["data/tasks_dropped_failed"] == 0 and m["data/tasks_recovered_late"] == 1
    assert m["data/main/groups_admitted"] == 1 and m.get("data/duplicates_ignored", 0) == 0
    assert task_accounting(m)["tasks_lost"] == 0
    # the second attempt's result, later
    assert dl.admit(again.lease_id, [group(again)]).status == "duplicate"


def test_a_result_for_a_lease_this_layer_never_issued_is_refused_and_counted():
    dl = DataLayer(RunSpec(), clock=Clock())
    [lease] = dl.lease(1)
    stranger = type(lease)("L99", lease.task, lease.routes, lease.deadline)
    assert dl.admit("L99", [group(stranger)]).status == "unknown"
    wrong_task = type(lease)(lease.lease_id, type(lease.task)("other", "x", "1+1"), lease.routes,
                             lease.deadline)
    assert dl.admit(lease.lease_id, [group(wrong_task)]).status == "unknown"
    assert dl.metrics()["data/results_unknown_lease"] == 2
    assert dl.admit(lease.lease_id, [group(lease)]).status == "new"


def test_data_parallel_rank_asking_ahead_of_the_publication_keeps_the_staleness_bound():
    """max_staleness 1, two ranks. Step 2 trains from version 2 whether or not rank 0 has published
    it yet, so version-0 groups may not be served for it (they were, checked against version 1)."""
    dl = DataLayer(RunSpec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=2,
                                                                    max_staleness=1))],
                           dataflow=DataflowSpec(lease_timeout_s=10.0, prefetch_steps=3.0)),
                   clock=Clock())
    for lease in dl.lease(6):
        dl.admit(lease.lease_id, [group(lease, version=0)])
    assert dl.next_batch("main", 0, rank=1, world_size=2) is not None
    dl.publish_version(ref(1))
    # version-0 groups at version 1: lag 1
    assert dl.next_batch("main", 1, rank=1, world_size=2) is not None
    # asked before version 2 is published
    assert dl.next_batch("main", 2, rank=1, world_size=2) is None
    assert dl.metrics()["data/main/groups_dropped_stale"] == 2
    dl.publish_version(ref(2))
    # nothing fresh: rank 0 waits too
    assert dl.next_batch("main", 2, rank=0, world_size=2) is None


def test_replayed_groups_obey_the_staleness_bound():
    dl = DataLayer(RunSpec(policies=[PolicySpec(trainer=TrainerSpec(groups_per_step=2,
                                                                    max_staleness=1))],
                           dataflow=DataflowSpec(lease_timeout_s=10.0, replay=Replay(ratio=0.5))),
                   clock=Clock())
    for version in range(4):
        for lease in dl.lease(2):
            dl.admit(lease.lease_id, [group(lease, version=version)])
        batch = dl.next_batch("main", version)
        assert batch is not None
        assert all(version - g.version <= 1 for g in batch), [(g.group_id, g.version)
                                                              for g in batch]
        dl.publish_version(ref(version + 1))
    assert dl.metrics()["data/main/stage/replay/stale_evicted"] > 0
