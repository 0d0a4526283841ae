"""The Dask task functions of the data path: `rollout -> score -> admit`, plus held-out `evaluate`.

They are module-level functions in an importable module so workers unpickle them by reference. Each is small: the
service does the work. Results are records (`LeaseResult`), which move worker to worker; no tensor crosses the
scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

from astratk.dataflow.datalayer import Lease
from astratk.dataflow.handle import DataLayerHandle
from astratk.rollout.service import LeaseResult, RunContext, get_service


def rollout_task(ctx: RunContext, leases: Sequence[Lease]) -> list[LeaseResult]:
    return get_service(ctx).rollout(leases)


def score_task(ctx: RunContext, results: Sequence[LeaseResult]) -> list[LeaseResult]:
    return get_service(ctx).score(results)


def admit_task(results: Sequence[LeaseResult], datalayer: DataLayerHandle) -> dict[str, float]:
    admitted = duplicates = samples = 0
    seconds = 0.0
    for res in results:
        out = datalayer.call("admit", res.lease_id, list(res.groups))
        admitted += out["admitted"]
        duplicates += out["duplicate"]
        samples += sum(len(g.trajectories) for g in res.groups)
        seconds += res.seconds
    return {"leases": float(len(results)), "groups_admitted": float(admitted), "duplicates": float(duplicates),
            "samples": float(samples), "rollout_seconds": seconds}


def evaluate_task(ctx: RunContext, policy_id: str, version: int | None, max_tasks: int) -> dict[str, float]:
    return get_service(ctx).evaluate(policy_id, version, max_tasks)
