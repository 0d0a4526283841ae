"""`cluster.dashboard: false` (the default) means no HTTP port: Dask's scheduler and workers serve their HTTP routes
(/health, /metrics, info pages) whatever `dashboard` says, a scheduler on 8787 by default, so the local cluster uses
`NoHTTPScheduler`/`NoHTTPWorker`, and the only ports it opens are the comm ports, all on 127.0.0.1. With
`dashboard: true` the dashboard is there, on 127.0.0.1 too."""

from __future__ import annotations

import psutil

from astratk.runtime.pools import NoHTTPWorker, start_pool_cluster, worker_specs
from astratk.spec import ClusterSpec, RunSpec


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket listening in these processes."""
    out = set()
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.add((c.laddr.ip, c.laddr.port))
    return out


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def cluster_pids() -> list[int]:
    me = psutil.Process()
    return [me.pid] + [p.pid for p in me.children(recursive=True)]


def test_local_cluster_without_dashboard_opens_no_http_port(processes: bool = False):
    """In-process workers here; tests/integration/test_local_cluster_ports.py runs it with worker processes."""
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, dashboard=False))
    before = listening(cluster_pids())
    with start_pool_cluster(spec, processes=processes) as cluster:
        cluster.wait_for_workers(2, timeout=60)
        info = cluster.scheduler_info
        opened = listening(cluster_pids()) - before
        comm = {port(cluster.scheduler_address)} | {port(a) for a in info["workers"]}
        if processes:  # each worker's nanny has a comm port of its own
            comm |= {port(w["nanny"]) for w in info["workers"].values()}
        assert info["services"] == {} and cluster.dashboard_link == ""  # no HTTP server in the scheduler
        assert all(w["services"] == {} for w in info["workers"].values())  # ... nor in a worker
        assert {p for _, p in opened} == comm  # nothing else listens, 8787 included
        assert {ip for ip, _ in opened} == {"127.0.0.1"}


def test_local_cluster_with_dashboard_serves_it_on_localhost():
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, dashboard=True))
    before = listening(cluster_pids())
    with start_pool_cluster(spec, processes=False) as cluster:
        cluster.wait_for_workers(2, timeout=60)
        opened = listening(cluster_pids()) - before
        dashboard = cluster.scheduler_info["services"]["dashboard"]
        assert ("127.0.0.1", dashboard) in opened and cluster.dashboard_link.startswith("http://127.0.0.1:")
        assert {ip for ip, _ in opened} == {"127.0.0.1"}


def test_worker_processes_are_built_without_http_unless_the_dashboard_is_on():
    off = worker_specs(RunSpec(cluster=ClusterSpec(rollout_workers=1)))
    assert {w["options"]["worker_class"] for w in off.values()} == {NoHTTPWorker}
    on = worker_specs(RunSpec(cluster=ClusterSpec(rollout_workers=1, dashboard=True)))
    assert NoHTTPWorker not in {w["options"]["worker_class"] for w in on.values()}
