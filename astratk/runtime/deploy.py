"""`deploy`: start the data layer (a Dask actor on the control worker) and the acquisition loop on any cluster.

Works the same on a `LocalCluster`/`SpecCluster`, on `dask scheduler` + `dask worker --resources ...` processes, or on
dask-jobqueue / dask-kubernetes clusters: it needs one worker labelled `control` and workers labelled
`rollout_<policy>` and `score`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from astratk.dataflow.client import DataLayerClient, bind_actor
from astratk.dataflow.datalayer import DataLayer
from astratk.records import RunContext, Shipped
from astratk.rollout.services import release_service
from astratk.runtime import registry
from astratk.runtime.acquisition import Acquisition
from astratk.runtime.cluster import wait_for_workers
from astratk.runtime.preflight import check_env_loads
from astratk.spec import SCORE_LABEL, LoraSpec
from astratk.weights.store import WeightStore

log = logging.getLogger(__name__)


@dataclass
class Deployment:
    ctx: RunContext
    datalayer: DataLayerClient
    acquisition: Acquisition
    store: WeightStore
    name: str | None = None
    client: Any = None

    def pause(self) -> None:
        """Stop leasing new tasks; chunks in flight finish and are admitted (nothing is lost)."""
        self.acquisition.pause()

    def resume(self) -> None:
        self.acquisition.resume()

    def stop(self) -> None:
        """Stop acquiring; then the data layer writes a final snapshot (when it has a store), so a later run can
        continue from exactly here."""
        # from here on a lost actor is shutdown, not a failure to repair (or to wait for)
        published, self.datalayer.recover, self.datalayer.published = self.datalayer.published, None, None
        self.acquisition.stop()
        try:
            self.datalayer.snapshot("final", timeout=30)
        except RuntimeError:  # no snapshot store configured
            pass
        if self.client is None:
            return
        release_services(self.client, self.ctx.run_id)
        try:
            if published is not None:
                self.client.unpublish_dataset(published)
            if self.name:
                registry.unpublish(self.client, self.name)
        except Exception:  # noqa: BLE001, S110 - the scheduler may already be gone at teardown
            pass


def release_services(client: Any, run_id: str, timeout_s: float = 30.0) -> None:
    """Every worker closes its rollout service of run `run_id` (its engines and their memory): workers outlive runs
    on a long-lived cluster, or a local one kept warm for the next run. A worker that does not answer within
    `timeout_s` keeps its service until it exits; the run is over either way."""
    try:
        client.run(release_service, run_id, on_error="ignore", callback_timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - teardown goes on; a worker that cannot be reached frees nothing
        log.warning("releasing run %s's rollout services: %s", run_id, e)


def deploy(ctx: RunContext, client: Any, *, timeout_s: float = 120.0, snapshot_url: str | None = None,
           restore: tuple[str, str | None] | None = None, name: str | None = None) -> Deployment:
    """Start the data layer actor (writing snapshots to `snapshot_url`; continuing from snapshot `restore` =
    (store URL, snapshot name or None for the newest) when given), tell it every policy's newest published version,
    start acquisition. With `name`, publish the deployment on the scheduler so trainer processes can attach
    (`astratk.runtime.registry`). Returns the handles.

    The current actor is also published as the Dask dataset `registry.datalayer_dataset(ctx.run_id)`: the copies of the
    handle that travel with rollout chains follow it to a replacement (`DataLayerClient`)."""
    spec = ctx.spec
    wait_for_workers(client, ["control"], 1, timeout_s)
    need = [f"rollout_{p}" for p in spec.served_ids()]
    wait_for_workers(client, need, 1, timeout_s)
    wait_for_workers(client, [SCORE_LABEL], 1, timeout_s)  # the same workers, or score-only ones (docs/cluster.md)
    check_env_loads(client, spec.env, timeout_s)  # a reward module the workers cannot import: one line, now
    store = WeightStore.from_spec(ctx.store_url, spec.weights)
    published = registry.datalayer_dataset(ctx.run_id)

    def start(restore_from: tuple[str, str | None] | None) -> Any:
        actor = start_datalayer(client, spec, timeout_s, snapshot_url, restore_from)
        for p in spec.policies:  # the newest weights (a replacement's snapshot may be a few versions behind)
            ref = store.latest(p.policy_id)
            if ref is None:
                raise ValueError(f"policy {p.policy_id!r} has no published weights in {ctx.store_url}; publish "
                                 "version 0 before deploying")
            actor.publish_version(ref).result(timeout=timeout_s)
        if snapshot_url:
            actor.snapshot("periodic").result(timeout=timeout_s)  # so a replacement always has a state to start from
        client.publish_dataset(actor, name=published, override=True)  # last: it is ready for callers
        if name:
            registry.publish(client, registry.DeploymentInfo(name, ctx, actor, snapshot_url, time.time()))
        return actor

    def recover() -> Any:
        """A replacement actor for a lost one, from the newest snapshot (the control worker's nanny restarts it)."""
        log.warning("the data-layer actor was lost with its worker; starting a replacement from the newest snapshot "
                    "in %s", snapshot_url)
        wait_for_workers(client, ["control"], 1, timeout_s)
        return start((snapshot_url, None))

    handle = DataLayerClient(start(restore), recover=recover if snapshot_url else None, published=published)
    acquisition = Acquisition(client, handle, ctx).start()
    return Deployment(ctx, handle, acquisition, store, name, client)


def start_datalayer(client: Any, spec: Any, timeout_s: float, snapshot_url: str | None = None,
                    restore: tuple[str, str | None] | None = None) -> Any:
    """The data-layer actor on the control worker, restored from a snapshot when `restore` is given. It calls
    through `client`, whether or not that is this process's default client (`bind_actor`)."""
    # shipped: the scheduler unpickles task arguments, and must not need the user's env code (`records.Shipped`)
    future = client.submit(DataLayer, Shipped.of(spec), snapshot_url=snapshot_url, actor=True,
                           resources={"control": 1}, pure=False)
    try:
        actor = bind_actor(future.result(timeout=timeout_s), client, future)
    except TimeoutError:
        raise TimeoutError(f"the data-layer actor did not start on the control worker within {timeout_s:.0f}s"
                           ) from None
    if restore is not None:
        url, name = restore
        actor.load_snapshot(url, name).result(timeout=timeout_s)
    return actor


def publish_initial(store: WeightStore, policy_id: str, model_path: str, lora: LoraSpec | None = None,
                    key: str = "model.lora") -> None:
    """Version 0 = the model directory's weights, so services catch up from the store like any later version.
    With `lora`, version 0 is the trainer's initial adapter (B = 0: the base's behaviour) and the store records the
    adapter config; a target module the model lacks fails here, naming `key`, before anything is written."""
    if lora is not None:
        from astratk.models.lora import adapter_config, initial_adapter

        state = initial_adapter(model_path, lora, key)
        store.set_adapter_config(policy_id, adapter_config(lora, model_path))
        store.publish(policy_id, 0, state)
        return
    from astratk.models.loading import load_causal_lm

    model = load_causal_lm(model_path)
    store.set_adapter_config(policy_id, None)  # full models from here on, whatever the store held before
    store.publish(policy_id, 0, unshared(model.state_dict()))


def unshared(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with a tensor that shares storage with an earlier one (tied embedding and head) copied, as safetensors
    needs; the others are passed as they are (copying every tensor of a 135M-parameter model took 2 s here)."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
