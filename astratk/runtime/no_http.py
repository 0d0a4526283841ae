"""Dask servers without an HTTP port: a preload that closes a scheduler's or worker's HTTP port (`dask scheduler
--preload astratk.runtime.no_http`, `dask worker --preload astratk.runtime.no_http`), and the scheduler and worker
classes of a run's own local cluster, which never open one.

Dask starts an HTTP server in every scheduler and worker, even with `--no-dashboard`, and it answers anyone, TLS or
not: `/health`, Prometheus `/metrics`, `/json/identity.json` (the workers by name and address), `/info` pages (worker
logs, call stacks), `/sitemap.json`. With a TLS cluster everything else needs a certificate your CA signed. This
preload stops that server as the process starts, so nothing listens but the (TLS) comm port; the environment
variables `DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES='[]'` and `DASK_DISTRIBUTED__WORKER__HTTP__ROUTES='[]'` leave
the server no routes for the moment before it stops. A run's own local cluster needs neither: its scheduler and
workers are `NoHTTPScheduler`/`NoHTTPWorker` (below), which start no HTTP server at all. They live here, away from the
pools, because a nanny's worker process imports its worker class's module first: this one imports only Dask, so a
worker that never generates (the data layer's `control` worker) starts without loading torch and transformers.

Kubernetes probes and the Dask operator use the scheduler's HTTP routes: leave the preload out there and keep the
port inside the cluster's network (docs/cluster.md).
"""

from __future__ import annotations

import logging
from typing import Any

from distributed import Scheduler, Worker
from distributed.http.routing import RoutingApplication

log = logging.getLogger(__name__)


def dask_setup(server: Any) -> None:
    """Stop `server`'s HTTP server (a scheduler or a worker); its comm port is untouched."""
    http = getattr(server, "http_server", None)
    if http is None:
        return
    http.stop()  # closes the listening sockets; Dask's own close() stops it again harmlessly
    services = getattr(server, "services", None)
    if isinstance(services, dict):
        services.pop("dashboard", None)  # no dashboard link to a closed port
    log.info("astratk.runtime.no_http: %s serves no HTTP", type(server).__name__)


class _NoHTTP:
    """A Dask server that starts no HTTP server: `dashboard=False` alone leaves Dask's own routes listening (on 8787
    for a scheduler without a dashboard address). Dask reads `http_application` when it stops its services; an empty
    one serves nothing, and without `services["dashboard"]` the dashboard link is empty."""

    def start_http_server(self, routes: Any, dashboard_address: Any, default_port: int = 0,
                          ssl_options: Any = None) -> None:
        self.http_application = RoutingApplication([])


class NoHTTPScheduler(_NoHTTP, Scheduler):
    """A `distributed.Scheduler` that listens on its comm port only (`cluster.dashboard: false`)."""


class NoHTTPWorker(_NoHTTP, Worker):
    """A `distributed.Worker` that listens on its comm port only (`cluster.dashboard: false`)."""
