"""A model checker for the data layer: hypothesis drives a real `DataLayer` through random
interleavings and checks the data path's invariants after every step.

Configurations: one or two policies (solver + verifier), one or two data-parallel ranks, version
barrier off / 0 / 1, synchronous mode on / off, publish_every 1-3 (per policy), staleness bounds 0-2, replay,
EDF, lag decay, a length filter, 1-3 attempts per task. Operations: lease, the clock moving (leases
expire), rollout results arriving (fresh, late, duplicated, after their lease was dropped, unscored
or without signal), rollouts failing, trainer ranks asking for their step's batch, rank 0 publishing
(possibly after the other ranks already asked for the next step), pausing, snapshots, a lost data
layer replaced from its last snapshot (with its trainers resumed from the matching checkpoint), and
an exact copy of the layer restored from `state_dict` that must then answer every call as the
original does.

Invariants:
- every lease ends admitted once or dropped with a counted reason: the layer's lease accounting
  balances exactly, and no lease id is admitted twice;
- no group joins a buffer twice (without replay, no group is served twice);
- every served group is within its policy's staleness bound at the version its batch is trained
  from;
- no deadlock: while every trainer keeps asking and rollouts come back, some unfinished policy makes
  progress;
- the restored copy behaves exactly as the original (same answers, same metrics).

Run longer with `pytest tests/unit/test_datalayer_model.py --hypothesis-profile=long` (profiles in
tests/conftest.py).
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.stages import EDF, FIFO, LengthFilter, Replay
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.workflows.solver_verifier import SolverVerifierEnv
from astratk.records import Group, Lease, Trajectory, WeightRef
from astratk.runtime.acquisition import task_accounting
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec

MAX_STEPS = 6


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Trainer:
    """One policy's data-parallel trainer as the data layer sees it: all ranks take step k's batch,
    then the step completes; rank 0 publishes after a publishing step, and only then asks for the
    next batch."""

    policy_id: str
    publish_every: int
    world_size: int
    # the step whose batch the ranks ask for
    step: int = 0
    # ranks holding this step's batch
    got: set[int] = field(default_factory=set)
    # version rank 0 still has to publish
    pending_publish: int | None = None

    @property
    def version(self) -> int:
        """The version of the weights this trainer trains at its current step."""
        return self.step // self.publish_every


@dataclass
class Rollout:
    lease: Lease
    # the policies' versions when the rollout started (its behaviour versions)
    versions: dict[str, int]


def _groups(lease: Lease, versions: dict[str, int], rewards: tuple[float | None, ...],
            long: bool) -> list[Group]:
    tokens = (1, 2, 3, 4, 5, 6, 7, 8) if long else (1, 2, 3)
    out = []
    for role, pid in lease.routes.items():
        trajs = tuple(Trajectory(task_id=lease.task.task_id,
                                 group_id=f"{lease.lease_id}/{role}/{i}", policy_id=pid,
                                 role=role, tokens=tokens, n_prompt=2,
                                 loss_mask=(1,) * (len(tokens) - 2),
                                 behavior_logprobs=(-1.0,) * (len(tokens) - 2),
                                 behavior_versions=(versions[pid],) * (len(tokens) - 2), reward=r)
                      for i, r in enumerate(rewards))
        out.append(Group(f"{lease.lease_id}/{role}", lease.task, pid, trajs))
    return out


configs = st.fixed_dictionaries({
    "policies": st.sampled_from([1, 2]),
    "world_size": st.sampled_from([1, 2]),
    "barrier": st.sampled_from([None, 0, 1]),
    "synchronous": st.booleans(),
    "publish_every": st.sampled_from([1, 2]),
    "verifier_publish_every": st.sampled_from([1, 2, 3]),
    "max_staleness": st.sampled_from([0, 1, 2]),
    "own_staleness": st.sampled_from([None, 0, 1]),
    "groups_per_step": st.sampled_from([1, 2, 3]),
    "prefetch_steps": st.sampled_from([1.0, 2.0, 3.5]),
    "max_task_attempts": st.sampled_from([1, 2, 3]),
    "replay": st.sampled_from([None, 0.34, 0.5]),
    "edf": st.booleans(),
    "lag_decay": st.sampled_from([1.0, 0.5]),
    "length_filter": st.booleans(),
})


def _spec(c: dict) -> RunSpec:
    def trainer(own: int | None, publish_every: int) -> TrainerSpec:
        return TrainerSpec(groups_per_step=c["groups_per_step"], max_steps=MAX_STEPS,
                           max_staleness=own, publish_every=1 if c["synchronous"] else publish_every)

    if c["policies"] == 1:
        env = ArithmeticEnv()
        policies = [PolicySpec(trainer=trainer(c["own_staleness"], c["publish_every"]))]
    else:
        env = SolverVerifierEnv()
        # each policy its own publication cadence: the barrier compares versions that move at different rates
        policies = [PolicySpec("solver", roles=["solver"],
                               trainer=trainer(c["own_staleness"], c["publish_every"])),
                    PolicySpec("verifier", roles=["verifier"],
                               trainer=trainer(None, c["verifier_publish_every"]))]
    dataflow = DataflowSpec(
        lease_timeout_s=10.0, max_staleness=c["max_staleness"], prefetch_steps=c["prefetch_steps"],
        max_task_attempts=c["max_task_attempts"], synchronous=c["synchronous"],
        lag_decay=c["lag_decay"], version_barrier=c["barrier"] if c["policies"] == 2 else None,
        order=EDF() if c["edf"] else FIFO(),
        replay=Replay(ratio=c["replay"]) if c["replay"] else None,
        filters=[LengthFilter(max_tokens=5)] if c["length_filter"] else [])
    return RunSpec(env=env, policies=policies, dataflow=dataflow)


class DataLayerMachine(RuleBasedStateMachine):
    @initialize(c=configs)
    def setup(self, c: dict) -> None:
        note(f"config {c}")
        self.c = c
        self.spec = _spec(c).validate()
        self.clock = Clock()
        self.dl = DataLayer(self.spec, clock=self.clock)
        # an exact copy restored from state_dict: must answer as dl does
        self.shadow: DataLayer | None = None
        self.trainers = {p.policy_id: Trainer(p.policy_id, p.trainer.publish_every, c["world_size"])
                         for p in self.spec.policies}
        self.bounds = {p.policy_id: 0 if c["synchronous"] else
                       (c["max_staleness"] if p.trainer.max_staleness is None
                        else p.trainer.max_staleness)
                       for p in self.spec.policies}
        # rollouts started and not yet returned or failed (a result may repeat)
        self.running: list[Rollout] = []
        # lease id -> admissions that the layer accepted
        self.admitted: dict[str, int] = {}
        self.served_fresh: set[str] = set()
        self.leased: set[str] = set()  # lease ids handed out (a re-issue keeps its id)
        # (layer state, model state) at the last snapshot
        self.saved: tuple[bytes, bytes] | None = None

    # -------------------------------------------------------------------------------------- helpers
    def both(self, method: str, *args):
        """Call `method` on the layer and its restored copy; both must answer the same."""
        out = getattr(self.dl, method)(*args)
        if self.shadow is not None:
            other = getattr(self.shadow, method)(*args)
            assert other == out, (f"restored copy answered {method}{args} with {other!r}, the "
                                  f"original {out!r}")
        return out

    def _finished(self, pid: str) -> bool:
        return self.trainers[pid].step >= MAX_STEPS

    # ---------------------------------------------------------------------------------------- rules
    @rule(n=st.integers(0, 4))
    def lease(self, n: int) -> None:
        versions = self.dl.versions()
        for lease in self.leases(n):
            self.running.append(Rollout(lease, dict(versions)))

    def leases(self, n: int) -> list[Lease]:
        """`lease(n)` on both copies; once every trainer has run its last step, only re-issues (no task
        is rolled out for steps that will never come)."""
        done = all(self._finished(pid) for pid in self.trainers)
        out = self.both("lease", n)
        for lease in out:
            assert not done or lease.lease_id in self.leased, (
                f"new task {lease.lease_id} leased after every trainer ran its last step")
            self.leased.add(lease.lease_id)
        return out

    @rule(dt=st.sampled_from([0.5, 4.0, 10.5]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @precondition(lambda self: self.running)
    @rule(data=st.data(), keep=st.booleans(),
          outcome=st.sampled_from(["signal", "signal", "flat", "unscored", "long"]))
    def result(self, data, keep: bool, outcome: str) -> None:
        """A rollout's result arrives (possibly again later: `keep`), whatever became of its lease
        meanwhile."""
        i = data.draw(st.integers(0, len(self.running) - 1))
        r = self.running[i] if keep else self.running.pop(i)
        rewards = {"signal": (1.0, 0.0), "flat": (1.0, 1.0), "unscored": (None, None),
                   "long": (0.0, 1.0)}[outcome]
        out = self.both("admit", r.lease.lease_id,
                        _groups(r.lease, r.versions, rewards, outcome == "long"))
        self._count_admission(r.lease.lease_id, out.status)

    def _count_admission(self, lease_id: str, status: str) -> None:
        assert status != "duplicate" or lease_id in self.admitted, (
            f"the result of lease {lease_id}, never admitted, was ignored as a duplicate")
        if status in ("new", "late", "held"):
            self.admitted[lease_id] = self.admitted.get(lease_id, 0) + 1
            assert self.admitted[lease_id] == 1, f"lease {lease_id} admitted twice"

    @rule(first=st.booleans())
    def slow_rollout(self, first: bool) -> None:
        """A task whose every attempt outlives its lease until the lease is dropped; then one
        attempt's result arrives (the first, or the last)."""
        versions = self.dl.versions()
        leases = self.leases(1)
        if not leases:
            return
        attempts = [Rollout(leases[0], dict(versions))]
        self.running += [Rollout(lease, dict(versions)) for lease in leases[1:]]
        for _ in range(self.c["max_task_attempts"]):
            self.clock.now += 10.5
            for lease in self.leases(1):
                r = Rollout(lease, self.dl.versions())
                (attempts if lease.lease_id == leases[0].lease_id else self.running).append(r)
        r = attempts[0] if first else attempts[-1]
        out = self.both("admit", r.lease.lease_id, _groups(r.lease, r.versions, (1.0, 0.0), False))
        self._count_admission(r.lease.lease_id, out.status)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def failure(self, data) -> None:
        r = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.both("release", [(r.lease.lease_id, r.lease.attempt)])

    @rule(n=st.integers(1, 4), flat=st.booleans())
    def rollouts(self, n: int, flat: bool) -> None:
        self.rollouts_return(n, flat)

    def rollouts_return(self, n: int, flat: bool) -> None:
        """The common path: tasks leased, rolled out and admitted at once (one without signal when
        `flat`)."""
        versions = self.dl.versions()
        for i, lease in enumerate(self.leases(n)):
            rewards = (1.0, 1.0) if flat and i == 0 else (1.0, 0.0)
            out = self.both("admit", lease.lease_id, _groups(lease, versions, rewards, False))
            self._count_admission(lease.lease_id, out.status)

    @rule(data=st.data())
    def ask(self, data) -> None:
        """A trainer rank asks for its step's batch (rank 0 only once it has published)."""
        pid = data.draw(st.sampled_from(sorted(self.trainers)))
        self._ask(pid, data.draw(st.integers(0, self.trainers[pid].world_size - 1)))

    @rule(data=st.data(), n=st.integers(0, 3), publish=st.booleans())
    def train(self, data, n: int, publish: bool) -> None:
        """The common path, for one trainer: `n` tasks rolled out and admitted at once, every rank
        asks (the others before rank 0), and rank 0 publishes now or later."""
        pid = data.draw(st.sampled_from(sorted(self.trainers)))
        self.rollouts_return(n, flat=False)
        for rank in reversed(range(self.trainers[pid].world_size)):
            self._ask(pid, rank)
        if publish:
            self._publish(pid)

    def _ask(self, pid: str, rank: int) -> None:
        t = self.trainers[pid]
        if t.step >= MAX_STEPS or rank in t.got or (rank == 0 and t.pending_publish is not None):
            return
        batch = self.both("next_batch", pid, t.step, rank, t.world_size)
        if batch is None:
            return
        t.got.add(rank)
        for g in batch:
            assert t.version - g.version <= self.bounds[pid], (
                f"{pid} step {t.step} trains from version {t.version} a group of version "
                f"{g.version} (bound {self.bounds[pid]})")
            if not self.c["replay"]:
                assert g.group_id not in self.served_fresh, f"group {g.group_id} served twice"
                self.served_fresh.add(g.group_id)
        # every rank has its share: the optimiser step runs
        if len(t.got) == t.world_size:
            t.step += 1
            t.got.clear()
            if t.step % t.publish_every == 0:
                t.pending_publish = t.step // t.publish_every

    @rule(data=st.data())
    def publish(self, data) -> None:
        self._publish(data.draw(st.sampled_from(sorted(self.trainers))))

    def _publish(self, pid: str) -> None:
        t = self.trainers[pid]
        if t.pending_publish is not None:
            self.both("publish_version",
                      WeightRef(pid, t.pending_publish, f"memory://{pid}/{t.pending_publish}"))
            t.pending_publish = None

    @rule(paused=st.booleans())
    def pause(self, paused: bool) -> None:
        self.both("set_paused", paused)

    @rule()
    def snapshot(self) -> None:
        """A data-layer snapshot with the matching trainer checkpoints (what a resumed run starts
        from)."""
        model = (self.trainers, self.admitted, self.served_fresh)
        self.saved = (pickle.dumps(self.dl.state_dict()), pickle.dumps(model))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def lose_layer(self) -> None:
        """The data layer's worker dies: a replacement restores the last snapshot and the trainers
        resume from their matching checkpoints. Rollouts still running may return to the
        replacement."""
        state, model = self.saved  # type: ignore[misc]
        self.dl = DataLayer.restore(self.spec, pickle.loads(state), clock=self.clock)
        self.trainers, self.admitted, self.served_fresh = pickle.loads(model)
        self.shadow = None

    @rule()
    def copy_layer(self) -> None:
        """An exact copy from `state_dict` (not a restore: leases stay out) that must then answer as
        the original."""
        self.shadow = DataLayer(self.spec, clock=self.clock)
        self.shadow.load_state_dict(pickle.loads(pickle.dumps(self.dl.state_dict())))

    # ----------------------------------------------------------------------------------- invariants
    @invariant()
    def leases_balance(self) -> None:
        m = self.dl.metrics()
        acc = task_accounting(m)
        assert acc["tasks_lost"] == 0, f"lease accounting does not balance: {acc}"
        assert m.get("data/tasks_dropped_failed", 0) >= 0
        # every counted drop is also a value, and the two agree
        drops = {(d.stage, d.reason, d.policy): d.count for d in self.dl.drops()}
        assert drops.get(("rollout", "failed", ""), 0) == m.get("data/tasks_dropped_failed", 0)
        for pid in self.trainers:
            for reason in ("stale", "overflow"):
                assert (drops.get(("serving", reason, pid), 0)
                        == m.get(f"data/{pid}/groups_dropped_{reason}", 0))
            for reason in ("zero_variance", "too_long", "empty"):
                assert (drops.get(("admission", reason, pid), 0)
                        == m.get(f"data/{pid}/groups_dropped_{reason}", 0))

    @invariant()
    def copy_matches(self) -> None:
        if self.shadow is not None:
            mine, theirs = self.dl.metrics(), self.shadow.metrics()
            for m in (mine, theirs):
                m.pop("data/snapshot_seconds", None)
            assert mine == theirs, {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                                    if mine.get(k) != theirs.get(k)}

    def teardown(self) -> None:
        if hasattr(self, "dl"):
            self.check_progress()

    def check_progress(self) -> None:
        """Liveness: on a copy, keep every trainer asking and every rollout returning (with a
        learning signal): every trainer must reach its last step within a bounded number of rounds
        (so no reachable state deadlocks)."""
        clock = Clock()
        clock.now = self.clock.now
        dl = DataLayer(self.spec, clock=clock)
        dl.load_state_dict(copy.deepcopy(self.dl.state_dict()))
        dl.set_paused(False)
        trainers = copy.deepcopy(self.trainers)
        start = {pid: t.step for pid, t in trainers.items()}
        running = list(self.running)
        for _ in range(20 * MAX_STEPS):
            if all(t.step >= MAX_STEPS for t in trainers.values()):
                return
            # leases of lost rollouts expire and are re-issued
            clock.now += 11.0
            versions = dl.versions()
            running += [Rollout(lease, dict(versions)) for lease in dl.lease(8)]
            for r in running:
                dl.admit(r.lease.lease_id, _groups(r.lease, r.versions, (1.0, 0.0), False))
            running = []
            for pid, t in trainers.items():
                if t.pending_publish is not None:
                    dl.publish_version(WeightRef(pid, t.pending_publish, "memory://x"))
                    t.pending_publish = None
                while t.step < MAX_STEPS and all(
                        dl.next_batch(pid, t.step, r, t.world_size) is not None
                        for r in range(t.world_size)):
                    t.step += 1
                    if t.step % t.publish_every == 0:
                        t.pending_publish = t.step // t.publish_every
                        break
        steps = {pid: t.step for pid, t in trainers.items()}
        raise AssertionError(f"deadlock: trainers stuck at steps {steps} (from {start}) while "
                             f"asking and rollouts return; data layer: {dl.status()}")

# settings: the active hypothesis profile (tests/conftest.py)
TestDataLayerModel = DataLayerMachine.TestCase
