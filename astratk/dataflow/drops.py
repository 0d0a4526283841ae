"""`DropLedger`: every drop on the data path as a value (`astratk.records.Drop`), kept beside the
flat counters.

Each part of the data layer counts its drops here with their stage, reason, unit and policy, so
readers (the run's metrics, dashboards, the model checker) get records instead of parsing counter
names. Drops counted per task keep their first task ids. `starvation_reason` reads two readings of
the records to say, in words, why a trainer got no batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from astratk.records import Drop

# task ids kept per kind of drop: enough to find the offending tasks, bounded in a long run
TASK_IDS_KEPT = 20

NO_ROLLOUT = "no rollout of this policy arrived meanwhile"  # a starved trainer's reason (the driver may add why)


class DropLedger:
    """Example:

    >>> ledger = DropLedger()
    >>> ledger.add("serving", "stale", "groups", "main", 2)
    >>> ledger.add("rollout", "prompt_too_long", "tasks", task_id="t7")
    >>> ledger.records()[1]
    Drop(stage='rollout', reason='prompt_too_long', unit='tasks', policy='', count=1.0, task_ids=('t7',))
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str, str, str]] = Counter()
        # the first TASK_IDS_KEPT task ids of drops counted per task
        self._task_ids: dict[tuple[str, str, str, str], list[str]] = {}

    def add(self, stage: str, reason: str, unit: str, policy: str = "", n: float = 1,
            task_id: str | None = None) -> None:
        key = (stage, reason, unit, policy)
        self._counts[key] += n
        if task_id is not None:
            ids = self._task_ids.setdefault(key, [])
            if len(ids) < TASK_IDS_KEPT:
                ids.append(task_id)

    def records(self) -> list[Drop]:
        return [Drop(*key, count=float(n), task_ids=tuple(self._task_ids.get(key, ())))  # type: ignore[arg-type]
                for key, n in self._counts.items()]

    def state_dict(self) -> list[tuple[Any, ...]]:
        return [(*key, n, tuple(self._task_ids.get(key, ()))) for key, n in self._counts.items()]

    def load_state_dict(self, state: list[tuple[Any, ...]]) -> None:
        # rows written before task ids were kept have five fields
        self._counts = Counter({tuple(row[:4]): row[4] for row in state})
        self._task_ids = {tuple(row[:4]): list(row[5]) for row in state if len(row) > 5 and row[5]}


# Why a kind of drop happens, in words (`starvation_reason`); other reasons are a filter's or a curator's name.
REASON_WORDS = {
    "zero_variance": "zero-variance: rewards all equal within each group",
    "stale": "stale: older than the staleness bound by the time they were served",
    "overflow": "buffer overflow: the trainer did not consume them",
    "empty": "empty: no sample of the group could be scored",
    "unscored": "unscored: the env returned no reward",
    "too_long": "too long (length_filter)",
    "too_short": "too short (length_filter)",
    "unfinished": "unfinished (length_filter)",
    "bad_format": "badly formatted (format_filter)",
    "prompt_too_long": "its prompt is longer than the model's context",
    "failed": "its rollouts failed every attempt (dataflow.max_task_attempts)",
}


def starvation_reason(policy_id: str, step: int, waited: float, before: tuple[dict[str, float], list[Drop]],
                      after: tuple[dict[str, float], list[Drop]]) -> str:
    """Why `policy_id` got no batch for `step` in `waited` seconds, in one line, from the data layer's counters and
    drops (`metrics()`, `drops()`) when the wait began (`before`) and when it gave up (`after`): what became of the
    groups and tasks of that time.

    >>> d = lambda n: [Drop("admission", "zero_variance", "groups", "main", n)]
    >>> reason = starvation_reason("main", 3, 300.0, ({"data/main/groups_received": 5}, d(5)),
    ...                            ({"data/main/groups_received": 9}, d(9)))
    >>> head, why = reason.split(": ", 1)
    >>> head
    "policy 'main' got no batch for step 3 in 300s"
    >>> why
    'all 4 groups rolled out since were dropped as zero-variance: rewards all equal within each group'
    """
    (m0, drops0), (m1, drops1) = before, after
    head = f"policy {policy_id!r} got no batch for step {step} in {waited:.0f}s"
    received = m1.get(f"data/{policy_id}/groups_received", 0.0) - m0.get(f"data/{policy_id}/groups_received", 0.0)
    admitted = m1.get(f"data/{policy_id}/groups_admitted", 0.0) - m0.get(f"data/{policy_id}/groups_admitted", 0.0)
    groups, tasks = _new_drops(drops0, drops1, policy_id)
    task_part = "; ".join(f"{n:.0f} task(s) dropped because {_task_words(stage, reason)}"
                          + (f" (e.g. {', '.join(ids[:3])})" if ids else "")
                          for (stage, reason), (n, ids) in tasks.items())
    if received <= 0:
        what = task_part or (f"are rollout workers running for label rollout_{policy_id}? (no task was dropped: "
                             "check the workers' logs)")
        return f"{head}: {NO_ROLLOUT}; {what}"
    dropped = "; ".join(f"{n:.0f} as {REASON_WORDS.get(reason, reason)}" for reason, n in groups.items())
    if admitted <= 0 and dropped:
        lead = (f"all {received:.0f} groups rolled out since were dropped as "
                f"{REASON_WORDS.get(next(iter(groups)), next(iter(groups)))}" if len(groups) == 1
                else f"all {received:.0f} groups rolled out since were dropped: {dropped}")
    else:
        lead = (f"{received:.0f} groups rolled out since, {admitted:.0f} admitted"
                + (f", dropped {dropped}" if dropped else "") + "; too few for a batch (trainer.groups_per_step)")
    return f"{head}: {lead}" + (f"; {task_part}" if task_part else "")


def _task_words(stage: str, reason: str) -> str:
    return REASON_WORDS.get(reason) or (f"the curator {reason!r} refused it" if stage == "curation" else reason)


def _new_drops(before: list[Drop], after: list[Drop], policy_id: str
               ) -> tuple[dict[str, float], dict[tuple[str, str], tuple[float, tuple[str, ...]]]]:
    """(group drops of `policy_id` by reason, task-level drops by (stage, reason) with their task ids) that
    happened between two `drops()` readings, largest first."""
    old = {(d.stage, d.reason, d.unit, d.policy): d for d in before}
    groups: dict[str, float] = {}
    tasks: dict[tuple[str, str], tuple[float, tuple[str, ...]]] = {}
    for d in after:
        prev = old.get((d.stage, d.reason, d.unit, d.policy))
        n = d.count - (prev.count if prev else 0.0)
        if n <= 0:
            continue
        if d.unit == "groups" and d.policy == policy_id:
            groups[d.reason] = groups.get(d.reason, 0.0) + n
        elif d.unit == "tasks":
            new_ids = tuple(i for i in d.task_ids if not prev or i not in prev.task_ids)
            tasks[(d.stage, d.reason)] = (n, new_ids or d.task_ids)
    return (dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            dict(sorted(tasks.items(), key=lambda kv: -kv[1][0])))
