"""A run's local cluster outlives the run for a while, and the next run in the same process with the same workers
starts on it.

Starting the local cluster is most of a small run's overhead: its worker processes import torch, transformers and
astratk (about 4 s here on 2 cores when spawned; see `astratk.runtime.worker_start`), and closing it takes another
1.5 s (the processes tear those modules down).
Measured on this project's 2-core machine, a 6-step tiny-model run took 6.5-7.3 s on a cluster of its own and
1.0-2.1 s on a kept one. Notebooks that rerun a cell, sweeps, benchmark grids and test suites run many runs in one
process; with `cluster.keep_warm_s` (default 300) each reuses the cluster the previous one left.

What is kept, and when it is reused:
- Only a local cluster of worker processes without autoscaling (`keep_warm_s: 0` turns it off). A cluster you
  started yourself (`cluster.scheduler_address`) is yours to keep or close.
- The next run takes it when its workers would be the same (`layout_key`: worker classes and counts, resource
  labels from the policy ids, threads per worker, GPUs, dashboard, the cores this process may run on, which spawned
  workers inherit) and every worker the cluster planned is up.
  Otherwise it starts its own, as before. The torch thread count may differ (a synchronous run gives each rollout
  worker more threads than an asynchronous one): `rethread` sets the new run's in the kept workers.
- A cluster is not kept when its pool was resized during the run, a worker is missing, or user code overran its time
  bound there (an abandoned thread may still be running in that worker: `astratk.rollout.bounded`).
- Code you edit: workers keep the modules they imported. A kept cluster is not reused once a source file of a module
  loaded here (outside the Python installation's own folders: your reward module, an editable install) has changed
  since the cluster was kept: the next run starts fresh workers that import the edited code.
- One cluster is kept at a time (the newest; the one before is closed), one run uses it at a time (a second run
  started meanwhile starts its own), and it is closed after `keep_warm_s` seconds without a run, by `close_kept()`,
  or when the process exits.

A run's state does not live in its workers: each run deploys its own data-layer actor and rollout services under its
own id and stops them at its end, as runs on a long-lived `dask scheduler` do.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from typing import Any

from astratk.spec import RunSpec

log = logging.getLogger(__name__)
_lock = threading.Lock()
_kept: dict[str, Any] = {}  # layout key -> (cluster, idle timer, source stamp); at most one entry


def layout_key(spec: RunSpec) -> str | None:
    """What a run's local cluster looks like from inside its workers, as a string; None when its cluster is neither
    kept nor taken from a previous run (threads mode, autoscaling). A run with `cluster.keep_warm_s: 0` still takes
    one: that setting says what happens at its end."""
    c = spec.cluster
    if not c.processes or c.autoscale is not None or c.scheduler_address:
        return None
    import dask

    pre_spawn = dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {}
    # workers inherit this process's CPU affinity when they start: a cluster started on other cores has other workers
    # (their thread plan and what a waiting trainer may lend them, `astratk.idle_cores`, count those cores)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return repr((affinity, sorted(p.policy_id for p in spec.policies), c.rollout_workers, c.pools, c.threads_per_worker,
                 c.rollout_gpus, c.dashboard, c.local_tls, spec.rollout.concurrent_chunks, sorted(pre_spawn.items())))


def rethread(client: Any, cluster: Any, threads: int, timeout_s: float = 30.0) -> None:
    """Give a kept cluster's workers this run's thread count (`astratk.cpu.run_threads`), as a fresh cluster would
    have started them with: the thread variables in each worker's environment (read by what starts later: vLLM's CPU
    backend reads OMP_NUM_THREADS), torch's intra-op threads, each nanny's environment for a worker it restarts, and
    the cluster's for a worker it adds. A worker that does not answer within `timeout_s` fails the run's start."""
    from astratk.runtime.pools import THREAD_ENV

    env = {k: str(threads) for k in THREAD_ENV}
    client.run(_worker_threads, env, threads, callback_timeout=timeout_s)
    client.run(_nanny_threads, env, nanny=True, callback_timeout=timeout_s)
    pre_spawn = getattr(cluster, "_pre_spawn", None)
    if pre_spawn is not None:
        pre_spawn.update(env)


def _worker_threads(env: dict[str, str], threads: int) -> None:
    os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def _nanny_threads(env: dict[str, str], dask_worker: Any) -> None:
    dask_worker.pre_spawn_env.update(env)
    dask_worker.env.update(env)


def take(key: str | None) -> Any | None:
    """The kept cluster for `key` if every worker it planned is up (it is no longer kept: the caller owns it); else
    None. A kept cluster that is not healthy is closed."""
    if key is None:
        return None
    with _lock:
        entry = _kept.pop(key, None)
    if entry is None:
        return None
    cluster, timer, stamp = entry
    timer.cancel()
    if _healthy(cluster) and source_stamp(stamp) == stamp:
        return cluster
    _close(cluster)
    return None


_one_shot = False  # inside `last_run()`: the process exits after this run, nothing to keep a cluster for


@contextlib.contextmanager
def last_run() -> Iterator[None]:
    """Inside: the run is this process's last (the `astratk run` command), so its cluster is closed at its end
    instead of kept for a next run that will not come."""
    global _one_shot
    _one_shot = True
    try:
        yield
    finally:
        _one_shot = False


def give_back(cluster: Any, key: str | None, keep_s: float, planned: set[str], reusable: bool) -> str:
    """At a run's end: keep `cluster` for the next run (`keep_s` seconds) or close it. `planned` is the worker names
    the run started with; `reusable` is False when the run found a reason not to keep it. Says which, for the log."""
    if (key is None or keep_s <= 0 or _one_shot or not reusable or set(cluster.worker_spec) != planned
            or not _healthy(cluster)):
        _close(cluster)
        return "closed"
    timer = threading.Timer(keep_s, _expire, args=(key, cluster))
    timer.daemon = True
    with _lock:
        older = list(_kept.values())
        _kept.clear()
        _kept[key] = (cluster, timer, source_stamp())
    for other, other_timer, _ in older:
        other_timer.cancel()
        _close(other)
    timer.start()
    return (f"kept for the next run in this process (closed after {keep_s:.0f}s without one, or at exit: "
            "cluster.keep_warm_s)")


def close_kept() -> int:
    """Close the kept cluster, if any (at exit, or before something that needs this process's children gone).
    Returns how many were closed."""
    with _lock:
        entries = list(_kept.values())
        _kept.clear()
    for cluster, timer, _ in entries:
        timer.cancel()
        _close(cluster)
    return len(entries)


def _expire(key: str, cluster: Any) -> None:
    with _lock:
        entry = _kept.get(key)
        if entry is None or entry[0] is not cluster:
            return  # taken by a run meanwhile, or replaced
        del _kept[key]
    _close(cluster)


def source_stamp(files: dict[str, int] | None = None) -> dict[str, int]:
    """{source file: mtime_ns} of `files` (default: every module loaded in this process from outside the Python
    installation's own folders). A file gone reads as -1."""
    if files is None:
        installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        files = {}
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path and path.endswith(".py") and not any(path.startswith(root) for root in installed):
                files[path] = 0
    out = {}
    for path in files:
        try:
            out[path] = os.stat(path).st_mtime_ns
        except OSError:
            out[path] = -1
    return out


def _healthy(cluster: Any) -> bool:
    from distributed.core import Status

    if cluster.status != Status.running:
        return False
    try:
        up = {str(w.get("name")) for w in cluster.scheduler_info.get("workers", {}).values()}
    except Exception:  # noqa: BLE001 - a cluster that cannot say is not reused
        return False
    return set(cluster.worker_spec) <= up


def _close(cluster: Any) -> None:
    try:
        cluster.close()
    except Exception as e:  # noqa: BLE001 - a cluster that fails to close is gone for our purposes
        log.warning("closing a local cluster: %s", e)


atexit.register(close_kept)  # before distributed's own atexit closes every cluster, so in a known order
