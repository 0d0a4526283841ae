"""Dask clusters for a run: a local one whose workers carry role resources, or a connection to an existing scheduler
(docs/architecture.md, "Runtime"), and counting labelled workers.

Local: `LocalCluster(resources=...)` gives every worker the same resources, so the local cluster is a
`SpecCluster` built from a per-worker spec (`astratk.runtime.pools`): one `control` worker that hosts the data-layer
actor (scaling never retires it) and the run's worker classes, by default `rollout_workers` workers labelled
`rollout_<policy>` for every policy plus `score`. Each process gets one torch thread by default (2-core laptops
oversubscribe otherwise). Everything binds to 127.0.0.1.

Existing scheduler (`cluster.scheduler_address`, docs/cluster.md): `connect(spec)` attaches with `cluster.tls`'s
certificates when given (`security(spec)`). With `cluster.tls` null, `distributed.Client` builds its `Security` from
Dask's config (`distributed.comm.tls.ca-file`, `.client.cert`, `.client.key`, e.g. from
`DASK_DISTRIBUTED__COMM__TLS__CA_FILE` / `__CLIENT__CERT` / `__CLIENT__KEY`, read when dask is first imported) or from
a `distributed.client.security-loader`; a `tls://` address with neither fails at validation with the fix.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from astratk.runtime.main_guard import check_main_guard
from astratk.spec import RunSpec
from astratk.spec.cluster import check_tls


def start_local_cluster(spec: RunSpec, processes: bool = True) -> Any:
    """A `PoolCluster` with a control worker and labelled rollout workers (`deploy` waits for them, with a timeout);
    its elastic class can be resized mid-run (`cluster.scale_pool(n)`, or Dask's adaptive scaling)."""
    from astratk.runtime.pools import start_pool_cluster

    if processes:  # spawned workers re-import the script that started the run: one line, not pages of tracebacks
        check_main_guard()
    return start_pool_cluster(spec, processes)


def count_workers(client: Any, resources: list[str]) -> int:
    """Workers that carry every label in `resources` right now (pools are elastic: ask again, don't cache)."""
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    return sum(all(w.get("resources", {}).get(r, 0) > 0 for r in resources) for w in workers)


def wait_for_workers(client: Any, resources: list[str], n: int, timeout: float) -> None:
    """Block until `n` workers carry every label in `resources`; the error names the labels it waited for."""

    deadline = time.monotonic() + timeout
    while True:
        have = count_workers(client, resources)
        if have >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {n} worker(s) with resources {resources}; {have} "
                               f"joined. Start workers with `dask worker ... --resources \"{resources[0]}=1\"`")
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------ an existing scheduler
def security(spec: RunSpec) -> Any:
    """The `distributed.Security` for `cluster.tls` (client role, encryption required), or None, which lets
    `distributed.Client` use Dask's config or security loader (see the module docstring)."""
    c = spec.cluster
    check_tls(c)
    if c.tls is None:
        return None
    from distributed import Security

    def path(p: str | None) -> str | None:
        return None if p is None else str(Path(p).expanduser())

    return Security(require_encryption=True, tls_ca_file=path(c.tls.ca_file), tls_client_cert=path(c.tls.cert),
                    tls_client_key=path(c.tls.key))


# How long refused connections are retried before giving up: a scheduler that is just starting (a job script that
# starts it beside its workers) gets this long to listen; an address that accepts waits the full startup timeout.
REFUSED_GRACE_S = 5.0


def check_listening(address: str, timeout_s: float, grace_s: float = REFUSED_GRACE_S) -> None:
    """Raise `ConnectionRefusedError` within `grace_s` (at most `timeout_s`) when nothing listens at a tcp:// or
    tls:// address: every attempt refused, or the host unknown. distributed's `Client` would retry those for its
    whole timeout (120 s by default) before saying anything. An address that accepts a connection, or one whose
    packets go unanswered, returns at once and gets the full timeout from the client."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme not in ("tcp", "tls") or not host or not port.isdigit():
        return  # other transports (inproc, ucx) and malformed addresses: distributed says what is wrong
    host, grace = host.strip("[]"), min(grace_s, timeout_s)
    deadline = time.monotonic() + grace
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic())):
                return
        except (ConnectionRefusedError, socket.gaierror) as e:
            if time.monotonic() >= deadline:
                raise ConnectionRefusedError(f"nothing accepts connections at {address} "
                                             f"({e.strerror or e}, retried for {grace:.0f}s)") from None
            time.sleep(0.25)
        except OSError:  # no answer (a firewall dropping packets, a host that is down): the client's timeout decides
            return


# distributed's `Client(timeout=...)` bounds connecting, not the handshake: against an address that accepts TCP and
# never answers (a wrong port, a half-dead scheduler) it waits forever. Clients are made on a thread given this long
# beyond the timeout.
HANDSHAKE_GRACE_S = 10.0


def open_client(address: str, timeout_s: float, security: Any = None, set_as_default: bool = False) -> Any:
    """A `distributed.Client` for `address` that fails in bounded time: `ConnectionRefusedError` within seconds when
    nothing listens (`check_listening`), `TimeoutError` when the address accepts but does not answer as a Dask
    scheduler within `timeout_s` + `HANDSHAKE_GRACE_S`, and distributed's own errors otherwise (all OSErrors)."""
    from distributed import Client

    check_listening(address, timeout_s)
    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["client"] = Client(address, timeout=timeout_s, security=security, set_as_default=set_as_default)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            made["error"] = e

    # A daemon thread: a handshake that never ends must not keep the process alive at exit.
    thread = threading.Thread(target=make, name=f"astratk-connect-{address}", daemon=True)
    thread.start()
    thread.join(timeout_s + HANDSHAKE_GRACE_S)
    if thread.is_alive():
        raise TimeoutError(f"{address} accepts connections but did not answer as a Dask scheduler within "
                           f"{timeout_s + HANDSHAKE_GRACE_S:.0f}s")
    if "error" in made:
        raise made["error"]
    return made["client"]


def connect(spec: RunSpec) -> Any:
    """A `distributed.Client` attached to `cluster.scheduler_address` (with `security(spec)`), waiting at most
    `cluster.startup_timeout_s`; the error names the address and what to check."""

    c = spec.cluster
    if not c.scheduler_address:
        raise ValueError("cluster.scheduler_address is null: there is no scheduler to connect to (a run then starts a "
                         "local cluster); give the address that `dask scheduler` prints")
    sec = security(spec)
    try:
        # not the process's default client: a run's client must not change Dask's process-wide settings
        return open_client(c.scheduler_address, c.startup_timeout_s, sec, set_as_default=False)
    except OSError as e:  # distributed's comm errors, SSL errors and its connect timeout are all OSErrors
        hint = "is `dask scheduler` running there, and reachable from this machine?"
        if c.scheduler_address.startswith("tls://"):
            hint += (" Over TLS, the scheduler's, the workers' and this client's certificates (cluster.tls or Dask's "
                     "TLS config) must be signed by one CA")
        if isinstance(e, ConnectionRefusedError):  # said in seconds by check_listening
            raise ConnectionError(f"could not connect to the Dask scheduler: {e}; {hint}") from e
        raise ConnectionError(f"could not connect to the Dask scheduler at {c.scheduler_address} within "
                              f"{c.startup_timeout_s:.0f}s (cluster.startup_timeout_s): {e}; {hint}") from e
