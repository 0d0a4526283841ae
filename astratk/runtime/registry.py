"""Named deployments on a Dask scheduler: how trainer jobs and `astratk status` find a running deployment.

`deploy(..., name=...)` publishes a `DeploymentInfo` (the run's context, the data-layer actor, where snapshots go) as
a Dask dataset `astratk-deployment-<name>` on the scheduler; any client of that scheduler (a trainer process started
by `astratk train fit`, a notebook, `astratk status`) fetches it by name. When the data layer is replaced after its
worker died, the new actor is published under the same name, and attached handles follow it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from astratk.dataflow.client import DataLayerClient, bind_actor
from astratk.records import RunContext

PREFIX = "astratk-deployment-"
DATALAYER_PREFIX = "astratk-datalayer-"


@dataclass
class DeploymentInfo:
    name: str
    ctx: RunContext
    datalayer: Any  # distributed.Actor of astratk.dataflow.datalayer.DataLayer
    snapshot_url: str | None
    started_at: float


def datalayer_dataset(run_id: str) -> str:
    """The Dask dataset holding the current data-layer actor of run `run_id`'s deployment (`deploy` publishes every
    replacement there; the handles that travel with rollout chains follow it)."""
    return DATALAYER_PREFIX + run_id


def publish(client: Any, info: DeploymentInfo) -> None:
    key = PREFIX + info.name
    if key in client.list_datasets():
        client.unpublish_dataset(key)
    client.publish_dataset(info, name=key)


def unpublish(client: Any, name: str) -> None:
    key = PREFIX + name
    if key in client.list_datasets():
        client.unpublish_dataset(key)


def names(client: Any) -> list[str]:
    return sorted(str(k)[len(PREFIX):] for k in client.list_datasets() if str(k).startswith(PREFIX))


def fetch(client: Any, name: str, timeout_s: float = 60.0) -> DeploymentInfo:
    """The deployment published as `name`, waiting up to `timeout_s` for it to appear (a trainer may start first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if PREFIX + name in client.list_datasets():
            info = client.get_dataset(PREFIX + name)
            info.datalayer = bind_actor(info.datalayer, client)  # `client`'s, whether or not it is the default
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"no astratk deployment {name!r} appeared on scheduler {client.scheduler.address} "
                               f"within {timeout_s:.0f}s; running deployments: {names(client) or 'none'} (start one "
                               "with `astratk deploy`)")
        time.sleep(0.5)


def attach(client: Any, name: str, timeout_s: float = 60.0) -> tuple[DeploymentInfo, DataLayerClient]:
    """The deployment and a handle to its data layer that follows a replacement actor (published under the same
    name by the deploying process) when the current one is lost."""
    info = fetch(client, name, timeout_s)

    def follow() -> Any:
        deadline = time.monotonic() + timeout_s
        lost = handle.target
        while time.monotonic() < deadline:
            actor = fetch(client, name, timeout_s).datalayer
            if actor.key != lost.key:
                return actor
            time.sleep(1.0)
        raise TimeoutError(f"deployment {name!r}: its data layer was lost and no replacement was published within "
                           f"{timeout_s:.0f}s; is the deploying process (`astratk deploy` or the run) alive?")

    handle = DataLayerClient(info.datalayer, recover=follow, published=datalayer_dataset(info.ctx.run_id))
    return info, handle
