"""`astratk status`: what runs on a scheduler: workers by label, and each deployment's data-layer state."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from astratk.dataflow.client import DataLayerClient
from astratk.runtime import registry
from astratk.runtime.cluster import open_client
from astratk.spec.cluster import dask_config_has_tls


def status_lines(scheduler: str, name: str | None = None, timeout_s: float = 30.0, security: Any = None
                 ) -> Iterator[str]:

    if scheduler.startswith("tls://") and security is None and not dask_config_has_tls():
        # distributed would fail deep in its TLS connector with a TypeError
        raise ValueError(f"{scheduler} is a TLS scheduler and no certificates were given: pass --config RUN.yaml "
                         "whose cluster.tls names them (ca_file, cert, key), or set Dask's "
                         "DASK_DISTRIBUTED__COMM__TLS__CA_FILE, __CLIENT__CERT and __CLIENT__KEY (docs/cluster.md)")
    try:
        # a private client (fetched actors are bound to it: registry.fetch); security: the run config's
        # cluster.tls, else Dask's config
        client = open_client(scheduler, timeout_s, security, set_as_default=False)
    except OSError as e:
        raise OSError(f"cannot reach the Dask scheduler at {scheduler} within {timeout_s:.0f}s ({e})") from None
    with client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        labels: Counter[str] = Counter()
        for w in workers.values():
            labels.update(w.get("resources", {}).keys())
        yield f"scheduler {scheduler}: {len(workers)} workers; labels " + (
            ", ".join(f"{k} x{v}" for k, v in sorted(labels.items())) or "none")
        names = registry.names(client) if name is None else [name]
        if not names:
            yield "no astratk deployments (start one with `astratk deploy`)"
        for n in names:
            info = registry.fetch(client, n, timeout_s)
            handle = DataLayerClient(info.datalayer, call_timeout_s=timeout_s)
            yield from _deployment_lines(info, handle.metrics())


def _deployment_lines(info: Any, m: dict[str, float]) -> Iterator[str]:
    spec = info.ctx.spec
    yield f"deployment {info.name!r} (run {info.ctx.run_id}, env {spec.env.name}, weights {info.ctx.store_url})"
    for p in spec.policies:
        k = f"data/{p.policy_id}/"
        yield (f"  {p.policy_id}: v{m.get(k + 'version', 0):.0f}/{p.trainer.max_steps}  buffer "
               f"{m.get(k + 'buffer_groups', 0):.0f}  admitted {m.get(k + 'groups_admitted', 0):.0f}  served "
               f"{m.get(k + 'groups_served', 0):.0f}  stale-dropped {m.get(k + 'groups_dropped_stale', 0):.0f}  "
               f"reward {m.get(k + 'reward_mean_received', float('nan')):.3f}")
    yield (f"  tasks: completed {m.get('data/tasks_completed', 0):.0f}, out {m.get('data/leases_outstanding', 0):.0f}"
           f", failed {m.get('data/tasks_dropped_failed', 0):.0f}; snapshots "
           f"{sum(v for k, v in m.items() if k.startswith('data/snapshots_')):.0f}, restores "
           f"{m.get('data/restores', 0):.0f}")
