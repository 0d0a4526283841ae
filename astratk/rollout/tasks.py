"""The Dask task functions of the data path: `rollout -> score -> admit`, plus held-out `evaluate`.

They are module-level functions in an importable module so workers unpickle them by reference. Each is small: the
service does the work. Results are records (`LeaseResult`), which move worker to worker; no tensor crosses the
scheduler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from distributed import get_worker

from astratk.dataflow.client import DataLayerClient
from astratk.records import Lease, LeaseResult, RunContext
from astratk.rollout.service import get_service


def rollout_task(ctx: RunContext, leases: Sequence[Lease]) -> list[LeaseResult]:
    return get_service(ctx).rollout(leases)


def score_task(ctx: RunContext, results: Sequence[LeaseResult]) -> list[LeaseResult]:
    return get_service(ctx).score(results)


def admit_task(results: Sequence[LeaseResult], datalayer: DataLayerClient) -> dict[str, Any]:
    """Admit each lease's groups (idempotent by lease id) in one data-layer call. Returns float totals plus, under
    "services", what each rollout service produced in this chunk (`astratk.runtime.acquisition.ServiceStats`
    aggregates them). In synchronous mode a round's groups are admitted when the round completes, so a chunk's
    "groups_admitted" counts whatever its call completed. A lease whose attempt failed (an episode or its scoring
    overran: `LeaseResult.failure`) is released for re-issue, counted as `<failure>s` (e.g. "episode_timeouts"); one
    whose task cannot be rolled out (`LeaseResult.dropped`) is dropped by the data layer, counted with its task id."""
    failed = [res for res in results if res.failure is not None]
    failures: dict[str, float] = {}
    for res in failed:
        failures[f"{res.failure}s"] = failures.get(f"{res.failure}s", 0.0) + 1.0
    if failed:
        for reason in {res.failure for res in failed}:
            datalayer.release([(res.lease_id, res.attempt) for res in failed if res.failure == reason], reason)
    results = [res for res in results if res.failure is None]
    # a task that cannot be rolled out (its prompt does not fit the model's context) is dropped, never re-issued
    if dropped := [(res.lease_id, res.dropped) for res in results if res.dropped is not None]:
        datalayer.drop_leases(dropped)
        results = [res for res in results if res.dropped is None]
    reply = datalayer.admit_many([(res.lease_id, res.groups) for res in results])
    current = reply.versions  # "current" for the version lag: the version at admission
    admitted = duplicates = samples = 0
    seconds = 0.0
    services: dict[str, dict[str, Any]] = {}
    for res, out in zip(results, reply.outcomes, strict=True):
        admitted += out.admitted
        duplicates += out.duplicate
        trained = [g for g in res.groups if g.policy_id in current]  # a frozen model's groups: counted at admission
        samples += sum(len(g.trajectories) for g in trained)
        seconds += res.seconds
        s = services.setdefault(res.service, {"hardware": res.hardware, "leases": 0.0, "groups_admitted": 0.0,
                                              "duplicates": 0.0, "samples": 0.0, "tokens": 0.0, "seconds": 0.0,
                                              "lags": [], "versions": [], "synced_versions": res.synced_versions,
                                              "lent_s": 0.0})
        s["leases"] += 1
        s["groups_admitted"] += out.admitted
        s["duplicates"] += out.duplicate
        s["seconds"] = max(s["seconds"], res.seconds)  # a chunk's leases run concurrently: its time is the longest
        s["lent_s"] = max(s["lent_s"], res.lent_s)  # the chunk's, on every lease
        for g in trained:
            s["samples"] += len(g.trajectories)
            s["tokens"] += sum(sum(t.loss_mask) for t in g.trajectories)
            if g.version >= 0:
                s["versions"].append(g.version)
                s["lags"].append(current[g.policy_id] - g.version)
    return {"leases": float(len(results)), "groups_admitted": float(admitted), "duplicates": float(duplicates),
            "samples": float(samples), "rollout_seconds": seconds, "services": services, **failures}


EVAL_STARTED = "astratk-eval-started"  # the Dask event topic an evaluation logs its token to when it starts running


def evaluate_task(ctx: RunContext, versions: dict[str, int | None], max_tasks: int, pass_k: int = 0,
                  token: str | None = None) -> dict[str, float]:
    """A held-out evaluation on this rollout worker. `token`: logged to the scheduler (topic `EVAL_STARTED`) as it
    starts, so that the driver counts `eval.timeout_s` from here, not from the time it queued behind rollout chunks."""
    if token is not None:
        with contextlib.suppress(ValueError):  # outside a worker (a test calling it directly): nothing to tell
            get_worker().log_event(EVAL_STARTED, token)
    return get_service(ctx).evaluate_versions(versions, max_tasks, pass_k)
