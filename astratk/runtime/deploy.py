"""`deploy`: start the data layer (a Dask actor on the control worker) and the acquisition loop on any cluster.

Works the same on a `LocalCluster`/`SpecCluster`, on `dask scheduler` + `dask worker --resources ...` processes, or on
dask-jobqueue / dask-kubernetes clusters: it needs one worker labelled `control` and workers labelled
`rollout_<policy>` and `score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astratk.dataflow.datalayer import DataLayer
from astratk.dataflow.handle import DataLayerHandle
from astratk.rollout.acquisition import Acquisition
from astratk.rollout.service import RunContext
from astratk.runtime.cluster import wait_for_workers
from astratk.weights.store import WeightStore


@dataclass
class Deployment:
    ctx: RunContext
    datalayer: DataLayerHandle
    acquisition: Acquisition
    store: WeightStore

    def stop(self) -> None:
        self.acquisition.stop()


def deploy(ctx: RunContext, client: Any, *, timeout_s: float = 120.0) -> Deployment:
    """Start the data layer actor, publish every policy's version 0, start acquisition. Returns the handles."""
    spec = ctx.spec
    wait_for_workers(client, ["control"], 1, timeout_s)
    need = [f"rollout_{p.policy_id}" for p in spec.policies]
    wait_for_workers(client, need + ["score"], 1, timeout_s)
    future = client.submit(DataLayer, spec, actor=True, resources={"control": 1}, pure=False)
    try:
        actor = future.result(timeout=timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the data-layer actor did not start on the control worker within {timeout_s:.0f}s"
                           ) from None
    handle = DataLayerHandle(actor)
    store = WeightStore.from_spec(ctx.store_url, spec.weights)
    for p in spec.policies:
        ref = store.latest(p.policy_id)
        if ref is None:
            raise ValueError(f"policy {p.policy_id!r} has no published weights in {ctx.store_url}; publish version "
                             "0 before deploying")
        handle.call("publish_version", ref)
    acquisition = Acquisition(client, handle, ctx).start()
    return Deployment(ctx, handle, acquisition, store)


def publish_initial(store: WeightStore, policy_id: str, model_path: str) -> None:
    """Version 0 = the model directory's weights, so services catch up from the store like any later version."""
    from astratk.models.loading import load_causal_lm

    model = load_causal_lm(model_path)
    store.publish(policy_id, 0, {k: v.detach().clone() for k, v in model.state_dict().items()})
