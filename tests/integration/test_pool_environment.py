"""Worker processes get the run's thread counts; the user's process keeps its own environment.

Dask's nanny writes its pre-spawn environment (OMP_NUM_THREADS=1, ...) into the parent's `os.environ` and leaves it
there, so every process a notebook starts after a run would inherit one OpenMP thread. The pool's nannies restore the
parent's values once their worker has spawned, also when a killed worker is restarted.
"""
from __future__ import annotations

import os
import signal
import time

from astratk.runtime.pools import start_pool_cluster
from astratk.spec import ClusterSpec, RunSpec

KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")


def _thread_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in KEYS}


def _rollout(client) -> dict[str, int]:
    """address -> pid of the rollout workers."""
    workers = client.scheduler_info()["workers"]
    addrs = [a for a, w in workers.items() if w["name"] != "control"]
    return client.run(os.getpid, workers=addrs) if addrs else {}


def test_workers_get_thread_counts_and_the_parent_keeps_its_environment(monkeypatch):
    from distributed import Client

    for key in KEYS:  # a shell that sets none of them (one that does keeps its values in the workers too: Dask's rule)
        monkeypatch.delenv(key, raising=False)
    before = _thread_env()
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, torch_threads=2)).validate()
    cluster = start_pool_cluster(spec)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=90)
            seen = client.run(lambda: os.environ.get("OMP_NUM_THREADS"))
            assert set(seen.values()) == {"2"}, seen  # every worker, control included, got the run's count
            assert _thread_env() == before

            # a killed worker is restarted by its nanny: same environment for it, none leaked here
            [pid] = _rollout(client).values()
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 90
            while True:
                try:
                    now = _rollout(client) if len(client.scheduler_info()["workers"]) == 2 else {}
                except OSError:  # the dead worker was still listed: its comm is closed
                    now = {}
                if now and pid not in now.values():
                    break
                assert time.monotonic() < deadline, "timed out after 90 s waiting for the nanny to restart the worker"
                time.sleep(0.5)
            assert set(client.run(lambda: os.environ.get("OMP_NUM_THREADS")).values()) == {"2"}
            assert _thread_env() == before
    finally:
        cluster.close()
    assert _thread_env() == before
