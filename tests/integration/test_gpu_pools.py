"""One local rollout worker per GPU, on real worker processes: each nanny sets its worker's CUDA_VISIBLE_DEVICES
before the worker starts, as dask-cuda's LocalCUDACluster does (`cluster.rollout_gpus`).

This machine has no GPU, so the driver is told it has three (torch.cuda's queries monkeypatched in this process
only); the worker processes are real, and what is checked is the environment they start with. tests/gpu/ checks
on a machine with two GPUs or more that each worker's cuda:0 is another GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from astratk.spec import ClusterSpec, RunSpec

pytestmark = pytest.mark.integration


def test_each_rollout_worker_process_starts_with_its_own_gpu_first(monkeypatch):
    from distributed import Client

    from astratk.runtime.pools import start_pool_cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7")
    spec = RunSpec(cluster=ClusterSpec(rollout_gpus=[0, 2], dashboard=False)).validate()
    with start_pool_cluster(spec) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)

        def visible():
            import os

            return os.environ.get("CUDA_VISIBLE_DEVICES")

        def by_name():
            seen = client.run(visible)
            names = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
            return {names[a]: v for a, v in seen.items()}

        first = by_name()
        assert first["rollout-0"] == "5,7" and first["rollout-1"] == "7,5"
        assert first["control"] == "5,6,7"  # the control worker keeps the driver's
        # resized (a user's scale_pool, or a replacement): a new worker takes the GPU no member holds
        cluster.scale_pool(1)
        client.wait_for_workers(2, timeout=60)
        deadline = time.monotonic() + 60
        while len(client.scheduler_info(n_workers=-1)["workers"]) > 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.scale_pool(2)
        client.wait_for_workers(3, timeout=120)
        after = by_name()
        assert after["rollout-0"] == "5,7" and after["rollout-2"] == "7,5"
        with pytest.raises(ValueError, match=r"one worker per GPU of cluster.rollout_gpus \(2\)"):
            cluster.scale_pool(3)
