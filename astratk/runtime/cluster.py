"""Local Dask clusters whose workers carry role resources (DESIGN §3 "Runtime").

`LocalCluster(resources=...)` gives every worker the same resources (TRAPS), so this builds a `SpecCluster` from a
per-worker spec: one `control` worker that hosts the data-layer actor (adaptive scaling must never retire it) and
`rollout_workers` workers labelled `rollout_<policy>` for every policy plus `score`. Each process gets one torch
thread by default (2-core laptops oversubscribe otherwise). Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import logging
from typing import Any

from astratk.spec import RunSpec

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def worker_specs(spec: RunSpec, processes: bool = True) -> dict[str, dict[str, Any]]:
    from distributed import Nanny, Worker

    cls = Nanny if processes else Worker
    common: dict[str, Any] = {"host": "127.0.0.1", "nthreads": spec.cluster.threads_per_worker}
    if processes:
        common["silence_logs"] = logging.WARNING  # worker INFO lines would drown the run's progress
    rollout = {f"rollout_{p.policy_id}": 1 for p in spec.policies} | {"score": 1}
    workers = {"control": {"cls": cls, "options": {**common, "nthreads": 1, "resources": {"control": 1}}}}
    for i in range(spec.cluster.rollout_workers):
        workers[f"rollout-{i}"] = {"cls": cls, "options": {**common, "resources": dict(rollout)}}
    return workers


def start_local_cluster(spec: RunSpec, processes: bool = True) -> Any:
    """A SpecCluster with a control worker and labelled rollout workers (`deploy` waits for them, with a timeout)."""
    import dask
    from distributed import Scheduler, SpecCluster

    dashboard = "127.0.0.1:0" if spec.cluster.dashboard else None
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": dashboard}}
    # Thread counts must be in a worker's environment before it imports numpy/torch, so they go in the nannies'
    # pre-spawn environment (read when each nanny is made, reused when it restarts a dead worker).
    pre_spawn = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {})
    pre_spawn.update({k: str(spec.cluster.torch_threads) for k in THREAD_ENV})
    with dask.config.set({"distributed.nanny.pre-spawn-environ": pre_spawn}):
        return SpecCluster(workers=worker_specs(spec, processes), scheduler=scheduler, name="astratk",
                           silence_logs=logging.WARNING)


def count_workers(client: Any, resources: list[str]) -> int:
    """Workers that carry every label in `resources` right now (pools are elastic: ask again, don't cache)."""
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    return sum(all(w.get("resources", {}).get(r, 0) > 0 for r in resources) for w in workers)


def wait_for_workers(client: Any, resources: list[str], n: int, timeout: float) -> None:
    """Block until `n` workers carry every label in `resources`; the error names the labels it waited for."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        have = count_workers(client, resources)
        if have >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {n} worker(s) with resources {resources}; {have} "
                               f"joined. Start workers with `dask worker ... --resources \"{resources[0]}=1\"`")
        time.sleep(0.2)
