"""Local Dask clusters whose workers carry role resources (DESIGN §3 "Runtime"), and counting labelled workers.

`LocalCluster(resources=...)` gives every worker the same resources (TRAPS), so the local cluster is a `SpecCluster`
built from a per-worker spec (`astratk.runtime.pools`): one `control` worker that hosts the data-layer actor (scaling
never retires it) and the run's worker classes, by default `rollout_workers` workers labelled `rollout_<policy>` for
every policy plus `score`. Each process gets one torch thread by default (2-core laptops oversubscribe otherwise).
Everything binds to 127.0.0.1.
"""

from __future__ import annotations

from typing import Any

from astratk.spec import RunSpec


def start_local_cluster(spec: RunSpec, processes: bool = True) -> Any:
    """A `PoolCluster` with a control worker and labelled rollout workers (`deploy` waits for them, with a timeout);
    its elastic class can be resized mid-run (`cluster.scale_pool(n)`, or Dask's adaptive scaling)."""
    from astratk.runtime.pools import start_pool_cluster

    return start_pool_cluster(spec, processes)


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
