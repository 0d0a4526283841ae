"""Worker pools: classes of workers with their own resource labels and (simulated) hardware, on an elastic cluster.

A pool is a list of `WorkerClass`es (defined in `astratk.spec`, re-exported here). `start_pool_cluster` builds a
`PoolCluster`: one `control` worker (it hosts the data-layer actor) plus `count` workers per class, named
`{class}-{i}`. Scaling touches one elastic class only, so neither `cluster.scale(n)` nor Dask's adaptive scaling can
retire the control worker (adaptive scaling chooses which workers to retire). A killed worker is restarted by its
nanny however long the new process takes to import its modules (Dask's `SpecCluster` would drop it after 15 s).

Several GPUs on one machine (`cluster.rollout_gpus: all` or `[1, 2, 3]`): one worker per GPU in the class "rollout",
named `rollout-{i}`, each with CUDA_VISIBLE_DEVICES set by its nanny before the worker starts, as dask-cuda's
`LocalCUDACluster` sets it (`astratk.gpu.cuda_visible_devices`: the list rotated so that the worker's GPU is its
cuda:0, where the engines' `device: auto` puts them). The class has one worker per GPU, so it is not elastic.

Heterogeneous hardware is *simulated* on one machine: a class's `slowdown` reaches its workers through the
`SimulatedHardware` worker plugin, and the rollout service sleeps (slowdown - 1) x its generation time after
generating (`astratk.rollout.service`). Workers started by hand name their class and slowdown in the environment:
`ASTRATK_WORKER_CLASS=gpu_slow ASTRATK_SIM_SLOWDOWN=3 dask worker ... --resources "rollout_main=1,score=1"`.

Example (a fast and a slow class; per-service throughput then shows up in the run's metrics, dimension `service`):

    >>> from astratk.spec import ClusterSpec, RunSpec, WorkerClass
    >>> spec = RunSpec(cluster=ClusterSpec(pools=[WorkerClass("gpu_fast", 1), WorkerClass("gpu_slow", 2, slowdown=3)]))
    >>> sorted(worker_specs(spec))
    ['control', 'gpu_fast-0', 'gpu_slow-0', 'gpu_slow-1']
    >>> cluster = start_pool_cluster(spec)  # doctest: +SKIP
    >>> cluster.scale_pool(4, "gpu_slow")  # doctest: +SKIP

HTTP: Dask's schedulers and workers always start an HTTP server (its routes: /health, Prometheus /metrics, /info
pages with worker logs and call stacks, JSON, statics), whatever `dashboard` says; a scheduler without a dashboard
address takes port 8787, and warns when another Dask holds it. With `cluster.dashboard: false` (the default) this
cluster's scheduler and workers are `NoHTTPScheduler`/`NoHTTPWorker`: nothing listens but their comm ports. With
`true`, the scheduler's dashboard is on 127.0.0.1, a free port (`Client.dashboard_link`).

Extending: another hardware class is another `WorkerClass`; nothing branches on its name.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dask
from dask.utils import parse_timedelta
from distributed import Nanny, Scheduler, SpecCluster, Worker
from distributed.core import Status
from distributed.deploy.cluster import Cluster
from distributed.utils import NoOpAwaitable

from astratk.gpu import cuda_visible_devices, rollout_gpus
from astratk.rollout.hardware import SimulatedHardware, worker_hardware
from astratk.runtime.no_http import NoHTTPScheduler, NoHTTPWorker
from astratk.runtime.worker_start import THREAD_ENV, WORKER_MODULE, EnvNanny, resolve_start_method
from astratk.spec import SCORE_LABEL, WorkerClass
from astratk.spec.cluster import serves_rollouts

if TYPE_CHECKING:
    from astratk.spec import RunSpec

__all__ = ["THREAD_ENV", "EnvNanny", "NoHTTPScheduler", "NoHTTPWorker", "PoolCluster", "SimulatedHardware",
           "WorkerClass", "pool_classes", "rollout_labels", "start_pool_cluster", "worker_hardware", "worker_specs"]

ALLOCATOR_ENV = ("MALLOC_TRIM_THRESHOLD_",)  # Dask's pre-spawn allocator setting, left out (start_pool_cluster)
CONTROL = "control"
ROLLOUT_MODULE = "astratk.rollout.tasks"  # what a pool's worker imports as it starts (Dask's worker `preload`)


def rollout_labels(policies: Sequence[str], concurrent: int = 1) -> dict[str, float]:
    """The labels a worker needs to serve every policy's rollouts and score them; each task takes 1 of a label, so
    `concurrent` (`rollout.concurrent_chunks`) chunks run on the worker at once."""
    return {f"rollout_{p}": concurrent for p in policies} | {SCORE_LABEL: concurrent}


def pool_classes(spec: RunSpec) -> list[WorkerClass]:
    """The run's worker classes: `cluster.pools`, or one class "rollout" of `cluster.rollout_workers` workers (one
    per GPU of `cluster.rollout_gpus` when it is set)."""
    if spec.cluster.rollout_gpus is not None:
        return [WorkerClass("rollout", len(worker_gpus(spec)))]
    return list(spec.cluster.pools) or [WorkerClass("rollout", spec.cluster.rollout_workers)]


def worker_gpus(spec: RunSpec) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each rollout worker `rollout-{i}` under `cluster.rollout_gpus` ([] when unset)."""

    if spec.cluster.rollout_gpus is None:
        return []
    gpus = rollout_gpus(spec.cluster.rollout_gpus)
    return [cuda_visible_devices(i, gpus) for i in range(len(gpus))]


def _class_spec(wc: WorkerClass, labels: dict[str, float], *, processes: bool, nthreads: int,
                dashboard: bool = False, start: str = "spawn") -> dict[str, Any]:
    resources = dict(labels if wc.resources is None else wc.resources)
    # a worker that runs several chunks at once needs a Dask thread for each
    concurrent = max((int(v) for k, v in resources.items() if k.startswith("rollout_")), default=1)
    # A pool's worker imports the rollout tasks' modules (the engines, torch, transformers: ~4 s of CPU here) as it
    # starts, while the cluster comes up, not on the clock of the run's first task; the control worker never needs them
    preload = [*(dask.config.get("distributed.worker.preload", default=None) or []), ROLLOUT_MODULE]
    options: dict[str, Any] = {"host": "127.0.0.1", "nthreads": max(wc.nthreads or nthreads, concurrent),
                               "resources": resources,
                               "plugins": [SimulatedHardware(wc.name, wc.slowdown)], "preload": preload}
    return _worker_spec(options, processes, dashboard, start)


def _control_spec(processes: bool, dashboard: bool = False, start: str = "spawn") -> dict[str, Any]:
    preload = list(dask.config.get("distributed.worker.preload", default=None) or [])
    return _worker_spec({"host": "127.0.0.1", "nthreads": 1, "resources": {CONTROL: 1}, "preload": preload},
                        processes, dashboard, start)


def _worker_spec(options: dict[str, Any], processes: bool, dashboard: bool, start: str) -> dict[str, Any]:
    """A worker in its own process (a nanny starts it, forked or spawned by `start`, and restarts it if it dies) or
    in this one; without the dashboard, one that opens no HTTP port."""
    worker = Worker if dashboard else NoHTTPWorker
    if not processes:
        return {"cls": worker, "options": options}
    # first: a forked worker's torch threads, before the rollout module's preload can use torch
    options = {**options, "preload": [WORKER_MODULE, *options["preload"]]}
    # worker INFO lines would drown the run's progress; the nanny builds `worker_class` in the worker's process
    return {"cls": EnvNanny, "options": {**options, "silence_logs": logging.WARNING, "worker_class": worker,
                                         "start_method": start}}


# lost-worker timeouts (distributed.deploy.lost-worker-timeout, 15 s by default) a nanny may spend restarting a killed
# worker before the cluster closes it and starts the worker afresh (PoolCluster._check_restart)
RESTART_PATIENCE = 10


def worker_specs(spec: RunSpec, processes: bool = True,
                 start: str | None = None) -> dict[str, dict[str, Any]]:
    """SpecCluster worker specs: `control` (one thread: it hosts the data-layer actor) plus `{class}-{i}` for every
    class of the run's pool. `start`: how their processes start (default: `cluster.worker_start` resolved here)."""
    labels = rollout_labels(spec.served_ids(), spec.rollout.concurrent_chunks)
    if start is None:
        start = resolve_start_method(spec.cluster.worker_start) if processes else "spawn"
    workers = {CONTROL: _control_spec(processes, spec.cluster.dashboard, start)}
    gpus = worker_gpus(spec)
    for wc in pool_classes(spec):
        for i in range(wc.count):
            workers[f"{wc.name}-{i}"] = spec_i = _class_spec(wc, labels, processes=processes,
                                                             nthreads=spec.cluster.threads_per_worker,
                                                             dashboard=spec.cluster.dashboard, start=start)
            if gpus:  # the nanny sets it in the worker's process before torch can initialise CUDA
                spec_i["options"]["env"] = {"CUDA_VISIBLE_DEVICES": gpus[i]}
    return workers


def _default_elastic(classes: Sequence[WorkerClass], labels: dict[str, float]) -> str:
    for wc in classes:
        if serves_rollouts(labels if wc.resources is None else wc.resources):
            return wc.name
    return classes[0].name


def start_pool_cluster(spec: RunSpec, processes: bool = True, *, elastic: str | None = None) -> PoolCluster:
    """A `PoolCluster` for the run's classes; `elastic` is the class `scale` resizes (default: `cluster.autoscale.pool`,
    else the first rollout class). Thread counts go into each nanny's pre-spawn environment (read before a worker
    imports numpy/torch, reused when the nanny restarts a dead worker). Everything binds to 127.0.0.1."""
    classes = pool_classes(spec)
    labels = rollout_labels(spec.served_ids(), spec.rollout.concurrent_chunks)
    if elastic is None and spec.cluster.autoscale is not None:
        elastic = spec.cluster.autoscale.pool
    elastic = elastic or _default_elastic(classes, labels)
    start = resolve_start_method(spec.cluster.worker_start) if processes else "spawn"
    templates = {wc.name: _class_spec(wc, labels, processes=processes, nthreads=spec.cluster.threads_per_worker,
                                      dashboard=spec.cluster.dashboard, start=start)
                 for wc in classes}
    pre_spawn = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {})
    from astratk.cpu import run_threads

    pre_spawn.update({k: str(run_threads(spec).rollout) for k in THREAD_ENV})
    # Dask sets MALLOC_TRIM_THRESHOLD_=65536 in its workers to hand freed memory back to the OS. Setting it switches off
    # glibc's dynamic mmap threshold: every allocation above 128 KiB (a decode step's logits, attention scores, the
    # KV cache as it grows) is then mapped and unmapped each time, and a rollout worker decoded SmolLM2 1.5x slower
    # (measured: 310 -> 205 tokens/s). The workers keep glibc's defaults (`ALLOCATOR_ENV`, below).
    for key in ALLOCATOR_ENV:
        pre_spawn.pop(key, None)
    gpus = worker_gpus(spec)
    return PoolCluster(worker_specs(spec, processes, start), templates, elastic, dashboard=spec.cluster.dashboard,
                       pre_spawn_environ=pre_spawn, gpus={"rollout": gpus} if gpus else None,
                       security=local_security() if spec.cluster.local_tls else None)


def local_security() -> Any:
    """Throw-away TLS credentials for one local cluster (`Security.temporary()`: a key and a self-signed certificate
    made in memory, never written to disk): its scheduler and workers accept only peers that hold them, so another
    user of the machine cannot connect and run code as you. The run's own client gets them from the cluster; its
    trainer processes through their environment (`tls_environ`)."""
    from distributed import Security

    return Security.temporary()


def tls_environ(security: Any) -> dict[str, str]:
    """Dask's configuration variables that give a process these TLS credentials, as a client and as a worker: a run's
    trainer processes (`astratk train fit` reaches the run's local cluster with them), or a `dask worker` you start
    yourself to join a local run's pool (`cluster.scheduler_address`-less runs: give it this environment). A
    process's environment is readable by its own user only (/proc/<pid>/environ)."""
    if security is None:
        return {}
    return {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": security.tls_ca_file,
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": security.tls_client_cert,
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": security.tls_client_key,
            "DASK_DISTRIBUTED__COMM__TLS__WORKER__CERT": security.tls_worker_cert,
            "DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY": security.tls_worker_key,
            "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}


class PoolCluster(SpecCluster):
    """A SpecCluster whose workers belong to named classes. `scale(n)` (total workers: Dask's meaning, and how the
    adaptive scaler calls it) and `scale_pool(n, cls)` add or remove workers of one class only, so `control` and the
    other classes are never retired by scaling (a crash is another matter: the nanny restarts a killed worker)."""

    def __init__(self, workers: dict[str, dict[str, Any]], templates: dict[str, dict[str, Any]], elastic: str, *,
                 dashboard: bool = False, pre_spawn_environ: dict[str, str] | None = None,
                 gpus: dict[str, list[str]] | None = None, security: Any = None) -> None:
        if elastic not in templates:
            raise ValueError(f"elastic pool {elastic!r} is not a worker class; classes are {sorted(templates)}")
        self.templates = templates
        self.elastic = elastic
        self.worker_class = {name: CONTROL if name == CONTROL else name.rsplit("-", 1)[0] for name in workers}
        self._next_index = {c: sum(1 for w in workers if self.worker_class[w] == c) for c in templates}
        self._pre_spawn = pre_spawn_environ  # every nanny's (thread counts): updated in place for a kept cluster
        self.tls = security  # the cluster's throw-away TLS credentials (`local_security`), or None: plain TCP
        for s in (*workers.values(), *templates.values()):
            self._share_pre_spawn(s)
        # class -> the CUDA_VISIBLE_DEVICES of its GPUs (cluster.rollout_gpus): one worker per GPU, also when resized
        self.gpus = gpus or {}
        self._lost: dict[str, str] = {}  # worker name -> address of its last process that left the scheduler
        # dashboard off means off: Dask's Scheduler(dashboard=False) still serves its HTTP routes, on 8787 when no
        # address is given (warning when another Dask holds it); NoHTTPScheduler opens no HTTP port at all
        scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": True,
                                                   "dashboard_address": "127.0.0.1:0"}}
        if not dashboard:
            scheduler = {"cls": NoHTTPScheduler, "options": {"host": "127.0.0.1", "dashboard": False}}
        if security is not None:  # TLS: only peers holding the cluster's credentials get in
            scheduler["options"].update(security=security, protocol="tls://")
        super().__init__(workers=workers, scheduler=scheduler, worker=templates[elastic], name="astratk",
                         silence_logs=logging.WARNING, security=security)

    def _share_pre_spawn(self, worker_spec: dict[str, Any]) -> None:
        """A nanny reads `pre-spawn-environ` (thread counts must be set before a worker imports numpy/torch) when it
        is created: each gets the cluster's own, not the global config's."""
        if self._pre_spawn is not None and worker_spec["cls"] is EnvNanny:
            worker_spec["options"]["pre_spawn_environ"] = self._pre_spawn
        if self.tls is not None:  # every worker (and nanny) of the cluster holds its TLS credentials
            worker_spec["options"]["security"] = self.tls

    def _update_worker_status(self, op: str, msg: Any) -> None:
        """A worker left the scheduler. SpecCluster closes its nanny for good when no worker of that name is back
        within `distributed.deploy.lost-worker-timeout` (15 s): right for a batch job that hung, wrong here, where the
        nanny is restarting a killed worker and the restart (a fresh process importing torch and the engines) took
        over 15 s on a busy 2-core machine, so the class lost the worker for the rest of the run. A nanny still
        restarting is left to finish, with a warning each time the timeout passes again; one that gave up, or is still
        restarting after `RESTART_PATIENCE` timeouts, is closed and the worker is started afresh from the spec."""
        info = self.scheduler_info.get("workers", {}).get(msg) if op == "remove" else None
        if op == "remove" and info is None:
            # a worker the cluster no longer lists (its removal raced the cluster's close): nothing to forget, and
            # Dask's own handlers would raise KeyError here, failing the close
            return None
        nanny = self.workers.get(info["name"]) if info else None
        if not isinstance(nanny, Nanny):  # in-process workers, or a name this cluster no longer runs: Dask's rule
            return super()._update_worker_status(op, msg)
        Cluster._update_worker_status(self, op, msg)  # Cluster's bookkeeping, without the hard close
        self._lost[info["name"]] = msg  # a later loss of the same name supersedes this one's watch
        self._watch_restart(info["name"], msg, nanny, waited=0)

    def _watch_restart(self, name: str, address: str, nanny: Nanny, waited: int) -> None:
        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        asyncio.get_running_loop().call_later(delay, self._check_restart, name, address, nanny, waited + 1, delay)

    def _check_restart(self, name: str, address: str, nanny: Nanny, waited: int, delay: float) -> None:
        back = any(w.get("name") == name for w in self.scheduler_info.get("workers", {}).values())
        if (back or self._lost.get(name) != address or self.status in (Status.closing, Status.closed)
                or self.workers.get(name) is not nanny or name not in self.worker_spec):  # scaled away meanwhile
            return
        # a process already `running` has registered with the scheduler, but the cluster's copy of the scheduler's
        # worker list may not hold it yet (its "add" arrives on another stream): it is back, not lost
        restarting = (nanny.status == Status.running and nanny.process is not None
                      and nanny.process.status in (Status.starting, Status.stopped, Status.init, Status.running))
        log = logging.getLogger(__name__)
        if restarting and waited < RESTART_PATIENCE:
            log.warning("worker %s: its nanny has been restarting it for %.0f s (a fresh process imports torch and the "
                        "engines; slow on a busy machine); still waiting", name, waited * delay)
            return self._watch_restart(name, address, nanny, waited)
        log.warning("worker %s did not come back within %.0f s (nanny %s); starting it afresh", name, waited * delay,
                    nanny.status.name)
        self._futures.add(asyncio.ensure_future(nanny.close()))
        del self.workers[name]
        self.loop.add_callback(self._correct_state)

    def protected(self) -> set[str]:
        """Workers that scaling never retires: `control` and every class but the elastic one."""
        return {n for n in self.worker_spec if self.worker_class.get(n) != self.elastic}

    def pool(self, worker_class: str | None = None) -> list[str]:
        """Planned workers of a class (default: the elastic one), oldest first."""
        c = worker_class or self.elastic
        return [n for n in self.worker_spec if self.worker_class.get(n) == c]

    def scale(self, n: int = 0, memory: Any = None, cores: Any = None) -> Any:
        """Total worker count `n` (Dask's meaning): the elastic class absorbs the difference. While closing, Dask's
        own meaning (SpecCluster closes its workers with `scale(0)`; keeping control then would leave it to die with
        the scheduler, "Worker process died unexpectedly")."""
        if self.status in (Status.closing, Status.closed):
            return super().scale(n)
        if memory is not None or cores is not None:
            raise ValueError("PoolCluster.scale: give a worker count; memory/cores targets are not supported")
        fixed = len(self.worker_spec) - len(self.pool())
        return self.scale_pool(max(0, n - fixed))

    def scale_pool(self, n: int, worker_class: str | None = None) -> Any:
        """Set the number of workers of `worker_class` (default: the elastic class) to `n`. Removes workers that
        have not started yet first, then the newest. Returns at once; workers start in the background."""
        c = worker_class or self.elastic
        if c not in self.templates:
            raise ValueError(f"no worker class {c!r}; classes are {sorted(self.templates)}")
        members = self.pool(c)
        if len(members) > n:
            started = {str(w.get("name")) for w in self.scheduler_info.get("workers", {}).values()}
            newest_first = members[::-1]
            order = [m for m in newest_first if m not in started] + [m for m in newest_first if m in started]
            for name in order[:len(members) - n]:
                del self.worker_spec[name]
        if c in self.gpus and n > len(self.gpus[c]):
            raise ValueError(f"worker class {c!r} runs one worker per GPU of cluster.rollout_gpus "
                             f"({len(self.gpus[c])}); it cannot have {n}")
        while len(self.pool(c)) < n and self.status not in (Status.closing, Status.closed):
            name = f"{c}-{self._next_index[c]}"
            self._next_index[c] += 1
            self.worker_spec[name] = self.templates[c]
            if c in self.gpus:  # a GPU no member holds, set by the nanny before the worker starts
                used = {self.worker_spec[m]["options"].get("env", {}).get("CUDA_VISIBLE_DEVICES")
                        for m in self.pool(c) if m != name}
                free = next(g for g in self.gpus[c] if g not in used)
                self.worker_spec[name] = spec_i = copy.deepcopy(self.templates[c])
                spec_i["options"]["env"] = {"CUDA_VISIBLE_DEVICES": free}
                self._share_pre_spawn(spec_i)  # the cluster's dict itself, not the deep copy
            self.worker_class[name] = c
        self.loop.add_callback(self._correct_state)
        return NoOpAwaitable() if self.asynchronous else None

    async def scale_down(self, workers: Any) -> None:
        """Dask's adaptive scaler retires workers through this: protected ones are refused (logged)."""
        keep = self.protected()
        refused = [w for w in workers if w in keep]
        if refused:
            logging.getLogger(__name__).warning("refusing to retire protected workers %s", refused)
        await super().scale_down([w for w in workers if w not in keep])
