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


def test_parent_environment_is_back_while_the_worker_is_still_starting(monkeypatch):
    """The restore happens once the worker's process exists, not once it has connected: a worker whose start takes
    seconds (here a preload that sleeps 4 s) leaves no window of that length in which the user's subprocesses would
    inherit the nanny's values (a CI run saw the old, connect-time restore lose this race)."""
    import asyncio

    import dask
    from distributed import Client, Scheduler

    from astratk.runtime.pools import EnvNanny

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    async def main() -> tuple[str | None, str | None, bool]:
        async with Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler:
            with dask.config.set({"distributed.nanny.pre-spawn-environ": {"OMP_NUM_THREADS": "3"}}):
                nanny = EnvNanny(scheduler.address, host="127.0.0.1", nthreads=1, dashboard=False,
                                 preload=["import time; time.sleep(4)"])
            start = asyncio.ensure_future(nanny.start())
            deadline = time.monotonic() + 60
            while getattr(getattr(nanny, "process", None), "pid", None) is None:
                assert time.monotonic() < deadline, "timed out after 60 s waiting for the worker's process to spawn"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # spawned, still sleeping in its preload: not connected yet
            during, connected = os.environ.get("OMP_NUM_THREADS"), bool(scheduler.workers)
            await asyncio.wait_for(start, 60)
            async with Client(scheduler.address, asynchronous=True) as client:
                seen = await asyncio.wait_for(client.run(lambda: os.environ.get("OMP_NUM_THREADS")), 30)
            await nanny.close()
            return during, next(iter(seen.values())), connected

    during, in_worker, connected = asyncio.run(main())
    assert not connected
    assert during is None  # the parent got its value back while the worker was still starting
    assert in_worker == "3", in_worker  # ... and the worker got the nanny's value



FORK_SCRIPT = """
import json, logging, os, sys
from distributed import Client
from astratk.runtime.pools import start_pool_cluster
from astratk.spec import ClusterSpec, RunSpec

def info():
    import torch
    return os.getppid(), torch.get_num_threads(), os.environ.get("ASTRATK_TEST_LATE")

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ["ASTRATK_TEST_LATE"] = "before"
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, torch_threads=2, worker_start="forkserver")).validate()
    cluster = start_pool_cluster(spec)
    out = {"me": os.getpid()}
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout=90)
        out["first"] = first = client.run(info)
        os.environ["ASTRATK_TEST_LATE"] = "after"
        # what Lightning sets as it loads: read later (or never) by the server's libraries, so still a fork
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"], os.environ["KMP_INIT_AT_FORK"] = "1", "FALSE"
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"  # what a plain Dask nanny leaves in os.environ
        cluster.scale_pool(2)
        client.wait_for_workers(3, timeout=90)
        out["added"] = added = {a: v for a, v in client.run(info).items() if a not in first}
        os.environ["HF_ASTRATK_TEST"] = "1"  # an HF_* variable: huggingface_hub reads those at import
        cluster.scale_pool(3)
        client.wait_for_workers(4, timeout=90)
        out["spawned"] = {a: v for a, v in client.run(info).items() if a not in first and a not in added}
    cluster.close()
    print(json.dumps(out))
"""


def test_forked_workers_see_what_spawned_ones_would(tmp_path):
    """`cluster.worker_start: forkserver`: workers are forks of one server process (not children of the process that
    started the cluster), with the run's torch threads (the server imported torch on one), that process's environment
    as of each worker's start (a variable set after the server started reaches the next worker), and a worker is
    spawned instead when a variable the preloaded libraries read at import changed since the server started. In a
    fresh process: this one's fork server is shared with every other test here, environment and all."""
    import json
    import subprocess
    import sys

    script = tmp_path / "fork_check.py"
    script.write_text(FORK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in KEYS and not k.startswith("HF_ASTRATK")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first, added, spawned = out["first"], out["added"], out["spawned"]
    parents = {ppid for ppid, _, _ in first.values()}
    assert len(parents) == 1 and out["me"] not in parents, (out, proc.stderr[-3000:])  # forks of one server
    assert {t for _, t, _ in first.values()} == {2} and {v for _, _, v in first.values()} == {"before"}, out
    assert [tuple(v) for v in added.values()] == [(*parents, 2, "after")], (out, proc.stderr[-3000:])
    assert [tuple(v) for v in spawned.values()] == [(out["me"], 2, "after")], out  # the process's own child
    assert "HF_ASTRATK_TEST changed since this process's fork server started" in proc.stderr
