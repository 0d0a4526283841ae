"""The Dask cluster a run uses (`ClusterSpec`): a local one started for the run, with its worker classes
(`WorkerClass`) and autoscaling (`AutoscaleSpec`), or an existing scheduler, over TLS (`TLSSpec`, `check_tls`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astratk.spec.base import Section, positive

# The resource label of workers that run score tasks (graders, code sandboxes): rollout workers by
# default, or score-only ones (docs/cluster.md).
SCORE_LABEL = "score"


@dataclass
class WorkerClass(Section):
    """One class of workers in a local pool (`astratk.runtime.pools`): `count` workers named
    `{name}-{i}`.

    `resources` None gives the rollout labels (`rollout_<policy>=1` for every policy, `score=1`); a
    dict is used as given, e.g. `{rollout_main: 1, score: 1, gpu_fast: 1}`. `slowdown` *simulates* a
    slower hardware class: after generating, the rollout service sleeps (slowdown - 1) x the
    generation time, so a class with slowdown 3 produces a third of the throughput of the same
    process with slowdown 1 (a laptop has one kind of hardware)."""

    SPEC_KEY = "cluster.pools[0]"

    name: str = "rollout"
    """the class's name; its workers are named {name}-{i}"""
    count: int = 1
    """workers of this class"""
    resources: dict[str, float] | None = None
    """Dask resource labels of its workers; null: rollout labels for every policy plus score"""
    slowdown: float = 1.0
    """simulate a slower hardware class: >= 1, the rollout service sleeps (slowdown - 1) x its generation time"""
    nthreads: int | None = None
    """None: cluster.threads_per_worker"""

    def validate(self, key: str = "cluster.pools[0]") -> None:
        """Its own fields; names unique across the pools and labels for every policy are the
        cluster's checks."""
        if not self.name or self.name == "control" or "/" in self.name:
            raise ValueError(f"{key}.name: {self.name!r} must be non-empty, unique, without '/', "
                             "and not 'control' (the data layer's worker)")
        if self.count < 0:
            raise ValueError(f"{key}.count must be >= 0, got {self.count}")
        if not 1.0 <= self.slowdown < float("inf"):
            raise ValueError(f"{key}.slowdown must be >= 1 (a simulated class can only be slower "
                             f"than this machine), got {self.slowdown}")
        if self.nthreads is not None and self.nthreads < 1:
            raise ValueError(f"{key}.nthreads must be >= 1 or null (cluster.threads_per_worker), "
                             f"got {self.nthreads}")
        if self.resources is not None and "control" in self.resources:
            raise ValueError(f"{key}.resources: 'control' marks the data layer's worker; remove it")


@dataclass
class AutoscaleSpec(Section):
    """AstraFlow's wait-fraction rule resizing one rollout pool of a local cluster
    (`astratk.runtime.autoscale`). The control worker (data layer) and the other pools are never
    retired."""

    SPEC_KEY = "cluster.autoscale"

    pool: str | None = None
    """the worker class to resize; None: the first class that carries rollout labels"""
    minimum: int = 1
    """fewest workers the pool keeps"""
    maximum: int = 8
    """most workers the pool grows to"""
    interval_s: float = 5.0
    """seconds between decisions (Dask's adaptive interval)"""
    ewma_decay: float = 0.8
    """weight of the past in the EWMAs of trainer wait and step time (ours; not published)"""
    cooldown_steps: int = 3
    """trainer steps observed after a resize before the next decision (let the EWMAs move)"""
    wait_count: int = 3
    """consecutive scale-down decisions before a worker is retired (Dask's adaptive wait_count)"""

    def validate(self, key: str = "cluster.autoscale") -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"{key}: need 1 <= minimum <= maximum, got {self.minimum}, "
                             f"{self.maximum}")
        if not 0.0 <= self.ewma_decay < 1.0:
            raise ValueError(f"{key}.ewma_decay must be in [0, 1), got {self.ewma_decay}")
        positive(key, interval_s=self.interval_s, wait_count=self.wait_count)
        if self.cooldown_steps < 0:
            raise ValueError(f"{key}.cooldown_steps must be >= 0, got {self.cooldown_steps}")


@dataclass
class TLSSpec(Section):
    """This process's TLS credentials for a `tls://` scheduler (`astratk.runtime.cluster.security`;
    docs/cluster.md). PEM files on the machine that runs the driver; workers get theirs from
    `dask worker --tls-*` flags."""

    SPEC_KEY = "cluster.tls"

    ca_file: str
    """the cluster's CA certificate: the scheduler's and workers' certificates must be signed by it"""
    cert: str
    """this client's certificate, signed by that CA (the scheduler and workers require one)"""
    key: str | None = None
    """its private key; None: the key is appended to `cert`"""


WORKER_STARTS = ("auto", "forkserver", "spawn")  # cluster.worker_start (astratk.runtime.worker_start)


@dataclass
class ClusterSpec(Section):
    SPEC_KEY = "cluster"

    scheduler_address: str | None = None
    """None: start a local cluster"""
    processes: bool = True
    """local cluster of worker processes; False: threads in this process (debuggers)"""
    local_tls: bool = True
    """a local cluster speaks TLS with throw-away credentials made for the run (in memory, never on disk), so no other
    process on the machine can connect to it and run code as you; false: plain TCP on 127.0.0.1, which any local user
    can reach (a machine of your own only)"""
    rollout_workers: int = 1
    """size of the one rollout pool (class "rollout") when `pools` is empty"""
    pools: list[WorkerClass] = field(default_factory=list)
    """heterogeneous local pools; replaces rollout_workers"""
    autoscale: AutoscaleSpec | None = None
    """None: fixed pools"""
    threads_per_worker: int = 1
    """Dask threads per worker process"""
    torch_threads: int | str = "auto"
    """torch threads per process. auto: from the cores this process may use and the run's placement: the trainer and
    the rollout workers split the cores when they work at once (asynchronous mode), each gets them all when they take
    turns (synchronous mode); the run prints its choice (`astratk.cpu.plan_threads`). An integer: every process."""
    lend_idle_cores: bool = True
    """with `torch_threads: auto` in the asynchronous mode: while a trainer waits for a batch, the rollout workers on
    its host run on its threads too, and give them back at their next decode step once it has its batch
    (`astratk.idle_cores`)"""
    cpu_linear: str = "auto"
    """The kernel behind nn.Linear on CPU, in every process: torch (its BLAS), onednn (oneDNN, inside torch), or auto:
    oneDNN where a start-up micro-benchmark finds it >= 15% faster (measured 2.2x on this project's AMD CI machines,
    where torch's MKL runs at half speed); same results up to fp32 rounding (`astratk.cpu`)."""
    dashboard: bool = False
    """serve Dask's dashboard (local clusters)"""
    startup_timeout_s: float = 120.0
    """longest wait for the cluster's workers to start (the error then names the missing ones)"""
    worker_start: str = "auto"
    """how a local cluster's worker processes start: forkserver (forked from a server process that imported torch and
    transformers once: a worker, a restart or an added worker starts in under a second instead of about four), spawn
    (Dask's default: each imports them itself), or auto: forkserver on Linux where torch sees no GPU, else spawn
    (`astratk.runtime.worker_start`)"""
    keep_warm_s: float = 300.0
    """after a run, its local cluster (worker processes, no autoscale) stays up this long for the next run in the same
    process with the same workers, which then starts in about a second instead of four or more (a notebook rerunning a
    cell, a sweep); 0: close it at the run's end (`astratk.runtime.warm`)"""
    tls: TLSSpec | None = None
    """TLS to an existing `tls://` scheduler; None: Dask's own config (DASK_DISTRIBUTED__COMM__TLS__*), if any"""
    rollout_gpus: str | list[int] | None = None
    """One local rollout worker per GPU, CUDA_VISIBLE_DEVICES set per worker as dask-cuda's LocalCUDACluster sets it
    (its GPU is its cuda:0): "all" (every GPU torch sees) or indices ([1, 2, 3]: leave cuda:0 to the trainer);
    replaces rollout_workers. None: every worker sees every GPU (the engines' device picks one)."""

    def validate(self, key: str = "cluster") -> None:
        """Ranges, pools and autoscale; TLS files and the labels every policy needs are in
        `astratk.spec.rules`."""
        positive(key, rollout_workers=self.rollout_workers,
                  threads_per_worker=self.threads_per_worker, startup_timeout_s=self.startup_timeout_s)
        k = self.keep_warm_s
        if isinstance(k, bool) or not isinstance(k, int | float) or not k >= 0 or k == float("inf"):
            raise ValueError(f"{key}.keep_warm_s must be a number of seconds >= 0 (0: close the local cluster at the "
                             f"run's end), got {k!r}")
        if self.worker_start not in WORKER_STARTS:
            raise ValueError(f"{key}.worker_start: unknown {self.worker_start!r}; choose one of {list(WORKER_STARTS)}")
        t = self.torch_threads
        if t != "auto" and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"{key}.torch_threads must be auto or an integer >= 1, got {t!r}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"{key}.cpu_linear: unknown {self.cpu_linear!r}; choose one of ['auto', 'onednn', "
                             "'torch']")
        names: set[str] = set()
        for i, wc in enumerate(self.pools):
            if wc.name in names:
                raise ValueError(f"{key}.pools[{i}].name: {wc.name!r} must be non-empty, unique, "
                                 "without '/', and not 'control' (the data layer's worker)")
            names.add(wc.name)
            wc.validate(f"{key}.pools[{i}]")
        a = self.autoscale
        if a is not None:
            if self.scheduler_address is not None:
                raise ValueError(f"{key}.autoscale resizes a local cluster's pool; with "
                                 f"{key}.scheduler_address, scale your cluster's own way "
                                 "(dask-jobqueue/kubernetes adapt) or remove autoscale")
            a.validate(f"{key}.autoscale")
            pools = [wc.name for wc in self.pools] or ["rollout"]
            if a.pool is not None and a.pool not in pools:
                raise ValueError(f"{key}.autoscale.pool: no worker class {a.pool!r}; classes are "
                                 f"{pools}")
        if self.rollout_gpus is not None:
            self._validate_gpus(key)

    def local_rollout_workers(self) -> int:
        """The rollout workers of a run's local cluster: its pools' classes that carry rollout labels (a class without
        its own `resources` gets them), one per GPU of `rollout_gpus`, else `rollout_workers`."""
        if self.pools:
            return sum(wc.count for wc in self.pools if wc.resources is None or serves_rollouts(wc.resources))
        if self.rollout_gpus is not None:
            return len(self.rollout_gpus) if isinstance(self.rollout_gpus, list) else 1
        return self.rollout_workers

    def _validate_gpus(self, key: str) -> None:
        """`rollout_gpus` pins the workers of the local cluster's one rollout class; which GPUs exist
        is checked on the machine (`astratk.spec.rules`)."""
        g = self.rollout_gpus
        indices = isinstance(g, list) and bool(g) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g)
        if g != "all" and not (indices and isinstance(g, list) and len(set(g)) == len(g)):
            raise ValueError(f"{key}.rollout_gpus must be 'all', a list of distinct GPU indices "
                             f"(e.g. [1, 2]) or null, got {g!r}")
        clash = ("scheduler_address" if self.scheduler_address is not None else
                 "pools" if self.pools else "autoscale" if self.autoscale is not None else
                 "processes: false" if not self.processes else None)
        if clash is not None:
            raise ValueError(f"{key}.rollout_gpus starts one local worker process per GPU, which "
                             f"{key}.{clash} rules out; remove one of them (on a cluster of your own, "
                             "start one `dask worker` per GPU: docs/cluster.md)")


def check_tls(c: ClusterSpec) -> None:
    """Cross-field TLS rules; raise ValueError naming the key and the fix. `cluster.tls` needs a `tls://` address and
    existing files; a `tls://` address needs `cluster.tls` or TLS client credentials in Dask's config."""
    address = c.scheduler_address or ""
    if c.tls is None:
        if address.startswith("tls://") and not dask_config_has_tls():
            raise ValueError(
                f"cluster.scheduler_address {address!r} is a TLS scheduler but this client has no certificates: set "
                "cluster.tls: {ca_file: ca.pem, cert: client.pem, key: client.key} (PEM files signed by the cluster's "
                "CA), or Dask's DASK_DISTRIBUTED__COMM__TLS__CA_FILE, __CLIENT__CERT and __CLIENT__KEY before "
                "starting (docs/cluster.md)")
        return
    if not address.startswith("tls://"):
        got = "null (a local cluster, which has no TLS)" if not address else repr(address)
        raise ValueError(f"cluster.tls is set but cluster.scheduler_address is {got}: give the tls://HOST:PORT address "
                         "that `dask scheduler --protocol tls ...` prints (`Scheduler at: tls://...`), or remove "
                         "cluster.tls")
    for name in ("ca_file", "cert", "key"):
        path = getattr(c.tls, name)
        if path is None and name == "key":  # Dask reads a key appended to the certificate file
            continue
        if not path or not Path(path).expanduser().is_file():
            what = {"ca_file": "the CA certificate that signed the scheduler's and workers' certificates",
                    "cert": "this client's certificate, signed by that CA",
                    "key": "the private key of cluster.tls.cert (or null when it is appended to the certificate)"}
            raise ValueError(f"cluster.tls.{name}: no file {path!r}; give the PEM file of {what[name]}")


def dask_config_has_tls() -> bool:
    """Whether `distributed.Client` would find TLS client credentials in Dask's config on its own: a CA and a client
    certificate (what `Security` needs to build an SSL context), or a security loader."""
    import dask

    def get(key: str) -> Any:
        return dask.config.get(key, default=None)

    tls = bool(get("distributed.comm.tls.ca-file") and get("distributed.comm.tls.client.cert"))
    return tls or bool(get("distributed.client.security-loader"))


def serves_rollouts(resources: Mapping[str, float] | None) -> bool:
    """Whether a worker with these Dask resources runs rollouts: a `rollout_<policy>` label above 0."""
    return any(k.startswith("rollout_") and v > 0 for k, v in (resources or {}).items())
