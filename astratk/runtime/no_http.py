"""A Dask preload that closes a scheduler's or worker's HTTP port: `dask scheduler --preload astratk.runtime.no_http`
and `dask worker --preload astratk.runtime.no_http`.

Dask starts an HTTP server in every scheduler and worker, even with `--no-dashboard`, and it answers anyone, TLS or
not: `/health`, Prometheus `/metrics`, `/json/identity.json` (the workers by name and address), `/info` pages (worker
logs, call stacks), `/sitemap.json`. With a TLS cluster everything else needs a certificate your CA signed. This
preload stops that server as the process starts, so nothing listens but the (TLS) comm port; the environment
variables `DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES='[]'` and `DASK_DISTRIBUTED__WORKER__HTTP__ROUTES='[]'` leave
the server no routes for the moment before it stops. A run's own local cluster needs neither: its scheduler and
workers start no HTTP server at all (`astratk.runtime.pools.NoHTTPScheduler`).

Kubernetes probes and the Dask operator use the scheduler's HTTP routes: leave the preload out there and keep the
port inside the cluster's network (docs/cluster.md).
"""

from __future__ import annotations

import logging
from typing import Any

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
