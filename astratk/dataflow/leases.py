"""`LeaseBook`: the data layer's ledger of task leases (AstraFlow's "before rollout" point).

A lease is one task to roll out, with a deadline. Every lease id the book creates ends in exactly
one place, once:

- **admitted**: a result for it arrived (`close` says "new"); a later result for the same id is a
  duplicate;
- **dropped**, with a counted reason: `failed` after `max_task_attempts` rollouts that failed or
  expired.

A result may also say that the task cannot be rolled out at all (`drop`: a prompt longer than the
model's context); that lease ends admitted, with its task counted dropped by that reason.

Until then it is *out* (outstanding, with a deadline) or *waiting* for re-issue. A lease that passes
its deadline is re-issued with the same id and the next attempt number, so a slow original and its
re-issue cannot both be admitted. A result may still arrive for a lease that was dropped after its
last attempt expired (a slow rollout, not a failed one): it is admitted then, and the drop is taken
back (`data/tasks_dropped_failed` goes down by one, `data/tasks_recovered_late` up), unless the
caller refuses late results (synchronous rounds), which counts it as `data/results_late_refused`. A
result for an id this book never issued, or whose task is not the lease's task (a lost data layer's
work reaching its replacement, which issued the id again), is refused and counted as
`data/results_unknown_lease`.

So at any moment `leases created = admitted + dropped + out + waiting`, exactly (`task_accounting`
in `astratk.runtime.acquisition` reads it from the counters). The book also reads the train task
stream (deterministic: a restored book re-creates it and skips what was read) and asks the curators,
through a callback, whether a new task is worth rolling out.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from astratk.dataflow.drops import DropLedger
from astratk.records import Lease, Task

CloseStatus = Literal["new", "late", "duplicate", "late_refused", "unknown"]


class LeaseBook:
    """Example:

    >>> from astratk.records import Task
    >>> book = LeaseBook(lambda: iter([Task("t0", "toy", "1+1"), Task("t1", "toy", "2+2")]),
    ...                  routes={"policy": "main"}, timeout_s=10.0, max_attempts=2,
    ...                  clock=lambda: 0.0)
    >>> [lease] = book.lease(1, new_room=1)
    >>> book.close(lease.lease_id, "t0"), book.close(lease.lease_id, "t0")
    ('new', 'duplicate')
    """

    def __init__(self, tasks: Callable[[], Iterator[Task]], routes: dict[str, str], *,
                 timeout_s: float, max_attempts: int, clock: Callable[[], float],
                 max_curator_skips: int = 1000) -> None:
        self._make_tasks = tasks
        self._tasks = tasks()
        # how far the train stream has been read (a restored book re-reads it to here)
        self._tasks_drawn = 0
        self._routes = dict(routes)
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.max_curator_skips = max_curator_skips
        self._clock = clock
        self._next = 0
        self._out: dict[str, Lease] = {}
        # expired or released, for re-issue in this order
        self._waiting: OrderedDict[str, Lease] = OrderedDict()
        self._admitted: set[str] = set()
        # dropped after max attempts: a late result may still be admitted
        self._dropped: dict[str, Lease] = {}
        self.counts: Counter[str] = Counter()
        self.drops = DropLedger()

    # -------------------------------------------------------------------------------------- issuing
    @property
    def in_flight(self) -> int:
        """Leases out or waiting for re-issue (work already counted against the prefetch room)."""
        return len(self._out) + len(self._waiting)

    @property
    def out(self) -> int:
        return len(self._out)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def lease(self, n: int, new_room: int,
              curate: Callable[[Task], str | None] = lambda task: None) -> list[Lease]:
        """Up to `n` leases: re-issues first (whatever `new_room` says: they are work already
        counted), then at most `new_room` new tasks that every curator accepts (`curate` returns the
        name of the first that refuses)."""
        self.expire()
        n = max(0, n)
        deadline = self._clock() + self.timeout_s
        out: list[Lease] = []
        while self._waiting and len(out) < n:
            _, old = self._waiting.popitem(last=False)
            out.append(dataclasses.replace(old, deadline=deadline, attempt=old.attempt + 1))
            self.counts["data/leases_reissued"] += 1
        want = len(out) + max(0, min(n - len(out), new_room))
        skipped = 0
        while len(out) < want:
            task = next(self._tasks, None)
            if task is None:
                break
            self._tasks_drawn += 1
            refused_by = curate(task)
            if refused_by is not None:
                self.counts[f"data/tasks_skipped_{refused_by}"] += 1
                self.drops.add("curation", refused_by, "tasks")
                skipped += 1
                if skipped >= self.max_curator_skips:
                    # nothing to hand out: fail loudly (leases already built are returned instead)
                    if not out:
                        self._too_many_skips(skipped)
                    break
                continue
            out.append(Lease(f"L{self._next}", task, dict(self._routes), deadline))
            self._next += 1
        for lease in out:
            self._out[lease.lease_id] = lease
        self.counts["data/leases_issued"] += len(out)
        return out

    def _too_many_skips(self, skipped: int) -> None:
        counts = {k.removeprefix("data/tasks_skipped_"): int(v) for k, v in self.counts.items()
                  if k.startswith("data/tasks_skipped_")}
        raise RuntimeError(f"curators refused {skipped} tasks in a row (refusals so far: "
                           f"{counts}): they reject what the train stream offers. Loosen them "
                           "(greso min_submit_easy/min_submit_hard, filter_solved threshold, "
                           "curriculum explore) or raise dataflow.max_curator_skips")

    # ------------------------------------------------------------------------------------- failures
    def expire(self) -> list[str]:
        """Move leases past their deadline to re-issue (or drop them after their last attempt);
        their ids."""
        now = self._clock()
        gone = [lease for lease in self._out.values() if lease.deadline < now]
        for lease in gone:
            del self._out[lease.lease_id]
            self.counts["data/leases_expired"] += 1
            self._requeue(lease)
        return [lease.lease_id for lease in gone]

    def release(self, leases: Sequence[tuple[str, int]], reason: str = "error") -> int:
        """A rollout for these (lease id, attempt) pairs failed: re-issue them now instead of at
        their deadline. Only the attempt that failed is released: if the lease already expired and
        was re-issued, the newer attempt is still running and is left alone. Returns how many were
        released."""
        released = 0
        for lease_id, attempt in leases:
            lease = self._out.get(lease_id)
            if lease is not None and lease.attempt == attempt:
                del self._out[lease_id]
                self.counts[f"data/leases_released_{reason}"] += 1
                self._requeue(lease)
                released += 1
        return released

    def _requeue(self, lease: Lease) -> None:
        if lease.attempt >= self.max_attempts:
            self._dropped[lease.lease_id] = lease
            self.counts["data/tasks_dropped_failed"] += 1
            self.drops.add("rollout", "failed", "tasks")
        else:
            self._waiting[lease.lease_id] = lease

    # -------------------------------------------------------------------------------------- results
    def close(self, lease_id: str, task_id: str | None, accept_late: bool = True) -> CloseStatus:
        """Record a result for `lease_id` (for task `task_id`; None: not checked) and say what it
        is: `new` (admit it), `late` (admit it: the lease had been dropped after its last attempt),
        `duplicate`, `late_refused` or `unknown` (do not admit). Each status but `new` is
        counted."""
        if lease_id in self._admitted:
            self.counts["data/duplicates_ignored"] += 1
            return "duplicate"
        lease = (self._out.get(lease_id) or self._waiting.get(lease_id)
                 or self._dropped.get(lease_id))
        if lease is None or (task_id is not None and task_id != lease.task.task_id):
            self.counts["data/results_unknown_lease"] += 1
            self.drops.add("rollout", "unknown_lease", "results")
            return "unknown"
        if lease_id in self._dropped:
            if not accept_late:
                self.counts["data/results_late_refused"] += 1
                self.drops.add("rollout", "late_refused", "results")
                return "late_refused"
            del self._dropped[lease_id]
            # the lease ends admitted instead: the drop is taken back
            self.counts["data/tasks_dropped_failed"] -= 1
            self.drops.add("rollout", "failed", "tasks", n=-1)
            self.counts["data/tasks_recovered_late"] += 1
            status: CloseStatus = "late"
        else:
            status = "new"
        self._out.pop(lease_id, None)
        self._waiting.pop(lease_id, None)
        self._admitted.add(lease_id)
        self.counts["data/tasks_completed"] += 1
        return status

    def drop(self, lease_id: str, reason: str, accept_late: bool = True) -> CloseStatus:
        """A result for `lease_id` that says its task cannot be rolled out at all (`reason`, e.g.
        `prompt_too_long`: every attempt would end alike). The lease closes as for any result (it
        counts in `data/tasks_completed`, a later result is a duplicate) and its task is counted
        dropped: `data/tasks_dropped_<reason>`, and a `rollout` drop with the task id."""
        lease = (self._out.get(lease_id) or self._waiting.get(lease_id)
                 or self._dropped.get(lease_id))
        status = self.close(lease_id, lease.task.task_id if lease else None, accept_late)
        if status in ("new", "late"):
            self.counts[f"data/tasks_dropped_{reason}"] += 1
            self.drops.add("rollout", reason, "tasks", task_id=lease.task.task_id)
        return status

    def is_admitted(self, lease_id: str) -> bool:
        return lease_id in self._admitted

    def is_dropped(self, lease_id: str) -> bool:
        return lease_id in self._dropped

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    def out_leases(self) -> list[Lease]:
        return list(self._out.values())

    # ------------------------------------------------------------------------------------- snapshot
    def state_dict(self) -> dict[str, Any]:
        now = self._clock()
        return {"tasks_drawn": self._tasks_drawn, "next": self._next,
                # time left, not a clock
                "out": [(lease, lease.deadline - now) for lease in self._out.values()],
                "waiting": list(self._waiting.values()),
                "admitted": sorted(self._admitted, key=_lease_number),
                "dropped": list(self._dropped.values()), "counts": dict(self.counts),
                "drops": self.drops.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tasks = self._make_tasks()
        self._tasks_drawn = int(state["tasks_drawn"])
        # skip what was read
        next(itertools.islice(self._tasks, self._tasks_drawn, self._tasks_drawn), None)
        self._next = int(state["next"])
        now = self._clock()
        self._out = {lease.lease_id: dataclasses.replace(lease, deadline=now + left)
                     for lease, left in state["out"]}
        self._waiting = OrderedDict((lease.lease_id, lease) for lease in state["waiting"])
        self._admitted = set(state["admitted"])
        self._dropped = {lease.lease_id: lease for lease in state["dropped"]}
        self.counts = Counter(state["counts"])
        self.drops.load_state_dict(state["drops"])

    def requeue_out(self) -> int:
        """After a restore: the leases that were out went to the lost layer. Queue them for re-issue
        at once, ahead of older re-issues and in lease order, keeping their ids (a late result of
        the lost layer's work cannot double them here) and their attempt numbers (the re-issue
        counts the attempt again)."""
        out = sorted(self._out.values(), key=lambda lease: _lease_number(lease.lease_id))
        self._out.clear()
        waiting = OrderedDict((lease.lease_id,
                               dataclasses.replace(lease, attempt=max(0, lease.attempt - 1)))
                              for lease in out)
        waiting.update(self._waiting)
        self._waiting = waiting
        self.counts["data/leases_restored"] += len(out)
        return len(out)

    def metrics(self) -> dict[str, float]:
        out = {**{k: float(v) for k, v in self.counts.items()},
               "data/leases_outstanding": float(len(self._out)),
               "data/leases_waiting_reissue": float(len(self._waiting))}
        if self._out and math.isfinite(self.timeout_s):  # how long the oldest lease out has been out (since issued)
            now = self._clock()
            out["data/oldest_lease_s"] = max(0.0, max(now - (lease.deadline - self.timeout_s)
                                                      for lease in self._out.values()))
        return out


def _lease_number(lease_id: str) -> int:
    return int(lease_id[1:])
