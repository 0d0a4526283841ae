"""`Session`: the live parts of a local run (models, cluster, deployment, evaluator, trainers), torn
down on exit.

Set-up (`__enter__`) is a list of named steps: build the models, publish their first weights (or
roll back to the resume point), start the cluster, deploy the data layer and the acquisition loop,
start the evaluator.

`train()` and `serve()` share one drive loop (`_drive`), the same for every policy, that reads like
the data path: evaluate the first version, start the trainers and periodic evaluation, wait for the
trainers, stop acquiring, evaluate the last version, collect every policy's rows and counters,
summarise. One policy trains in this process (a notebook can step through it); several policies
train together, each in its own `astratk train fit` process attached to this deployment by name
(`astratk.runtime.trainer_job`), exactly as cluster jobs do; `astratk.training.build` wires both.
`serve()` trains nothing here: trainer jobs attach from elsewhere.

The run loop is `astratk.runtime.drive`, the wrap-up (evaluations, collected rows, summary)
`astratk.runtime.wrap_up`, the metrics reported while it runs `astratk.runtime.live_metrics`, the resume point
`astratk.runtime.resume`; this module holds the session's state and its set-up and teardown.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from astratk import idle_cores
from astratk.models import ensure_model
from astratk.models.tools import tool_status
from astratk.records import Drop, RunContext
from astratk.rollout.bounded import abandoned_threads
from astratk.runtime import warm
from astratk.runtime.checks import check_frozen_model
from astratk.runtime.cluster import connect, start_local_cluster
from astratk.runtime.drive import Drive
from astratk.runtime.live_metrics import LiveMetrics
from astratk.runtime.resume import ResumePoint, copy_version, find_resume_point
from astratk.runtime.wrap_up import WrapUp
from astratk.spec import RunSpec
from astratk.spec.cluster import serves_rollouts


def _quiet_dask() -> None:
    logging.getLogger("distributed").setLevel(logging.WARNING)


class Session(Drive, WrapUp, LiveMetrics):
    """A run's live parts and state; the run loop, the wrap-up and the live metrics are its mixins."""

    def __init__(self, spec: RunSpec, run_dir: Path, printer: Callable[[str], None],
                 deployment_name: str | None = None) -> None:
        if len(spec.policies) > 1 and spec.resume_from:
            raise ValueError("resume_from: resuming a multi-policy run is not supported yet; "
                             "resume each policy's trainer with `astratk train fit --ckpt_path "
                             "...` against a deployment restored from its snapshot")
        self.spec = spec
        self.run_dir = run_dir
        self.print = printer
        self.step_rows: dict[str, list[dict[str, float]]] = {}
        self.eval_rows: dict[str, list[dict[str, float]]] = {}
        self.counters: dict[str, float] = {}
        self.drops: list[Drop] = []
        # per rollout service (worker): throughput, version lag
        self.service_rows: dict[str, dict[str, Any]] = {}
        self.cluster: Any = None  # the local PoolCluster (None when attached to a scheduler)
        self.autoscale: Any = None  # WaitFractionMonitor when cluster.autoscale is on
        self.model_paths: dict[str, str] = {}
        self.tools_shown: dict[str, tuple[bool, str]] = {}  # policy -> (its prompts show the tools, the format)
        self.resume_point: ResumePoint | None = None  # with resume_from (one policy only)
        self.stream: Any = None  # the in-process trainer's GroupStream (single-policy runs)
        self.recorders: dict[str, Any] = {}  # the in-process trainer's StepRecorder: its rows grow as it trains
        self.trainer_loggers: list[Any] = []  # the in-process trainer's Lightning loggers (evaluations go there too)
        self._early_evals: list[dict[str, float]] | None = []  # evaluations done before those loggers existed
        self._loggers_lock = threading.Lock()
        self._logger_error: str | None = None
        self.metrics_writes = 0  # partial metrics.nc files written while training (metrics_every_s)
        self.trainer_error: BaseException | None = None  # what the in-process trainer raised, if it did
        self.starvation: Any = None  # the StarvationMonitor while training (astratk.runtime.starvation)
        # per policy: the groups its trainer trained on, in order
        self.group_ids: dict[str, list[str]] = {}
        self.state = "starting"  # starting | training | paused | finished | failed
        self._name = deployment_name
        self._closers: list[Callable[[], Any]] = []  # run on exit, the last registered first
        self._exc: BaseException | None = None  # what ended the run's `with` block, if anything did
        self.cluster_reused = False  # the local cluster was kept warm by an earlier run (astratk.runtime.warm)
        self._cluster_clean = False  # whether the local cluster may serve the next run (set at exit)
        self._warm_key: str | None = None  # the local cluster's layout when it may be kept (astratk.runtime.warm)

    def _first_version(self) -> int:
        """The version training starts from: 0, or the resume point's step (a version per step)."""
        return self.resume_point.step if self.resume_point else 0

    # --------------------------------------------------------------------------------- set-up
    def __enter__(self) -> Session:  # noqa: PYI034 - typing.Self needs Python 3.11
        try:
            return self._set_up()
        except BaseException as e:
            # `with` runs no __exit__ when __enter__ raises: close what set-up started (a cluster, a deployment)
            self.__exit__(type(e), e, e.__traceback__)
            raise

    def _set_up(self) -> Session:
        from astratk.rollout.service import _quiet_transformers

        _quiet_transformers()
        _quiet_dask()
        self._place_cpu()
        self._build_models()
        store_url = self._prepare_weights()
        t = time.perf_counter()
        self._start_cluster()
        from astratk import cpu

        rollout_threads = self._place_cpu_on_cluster() if self._plan_per_host() else None
        ctx = RunContext(run_id=uuid.uuid4().hex[:12], spec=self.spec, model_paths=dict(self.model_paths),
                         store_url=store_url, cpu_linear=cpu.linear_backend(),  # one choice for every process
                         rollout_threads=rollout_threads)
        self._deploy(ctx)
        self.idle_dir = idle_dir = idle_cores.run_dir_for(ctx.run_id)  # a waiting trainer lends its cores here
        self._on_exit(lambda: shutil.rmtree(idle_dir, ignore_errors=True))
        workers = len(self.client.scheduler_info()["workers"])
        dashboard = self.client.dashboard_link if self.spec.cluster.dashboard else "off"
        kept = ", kept warm by the previous run" if self.cluster_reused else ""
        self.print(f"cluster up with {workers} workers ({time.perf_counter() - t:.0f}s{kept}); "
                   f"dashboard: {dashboard}")
        self._start_evaluator(ctx)
        return self

    def __exit__(self, *exc: object) -> None:
        self._exc = exc[1] if exc else None
        for close in self._closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - teardown runs to the end; report what failed
                self.print(f"while shutting down: {e!r}")

    def _on_exit(self, close: Callable[[], Any]) -> None:
        self._closers.insert(0, close)

    def _place_cpu(self) -> None:
        """This process's torch threads and Linear kernel (`astratk.cpu`), said once: the trainer runs here."""
        from astratk import cpu

        plan = cpu.run_threads(self.spec)
        torch.set_num_threads(plan.trainer)
        self.trainer_threads = plan.trainer
        self.rollout_workers_here = self.spec.cluster.local_rollout_workers()  # a cluster of your own: counted later
        cpu.set_linear_backend(self.spec.cluster.cpu_linear)
        linear = cpu.linear_backend()
        speed = cpu.onednn_speedup() if self.spec.cluster.cpu_linear == "auto" else None
        self._linear_line = f"Linear layers: {linear}" + (f" ({speed:.1f}x torch's BLAS here)" if speed else "")
        bf16 = cpu.bf16_warning(self.spec)
        if bf16 is not None:
            self.print(bf16)
        if not self._plan_per_host():  # else said once the cluster's workers are known (`_place_cpu_on_cluster`)
            self.print(f"CPU: torch threads trainer {plan.trainer}, each rollout worker {plan.rollout} "
                       f"({plan.reason}{self._lend_words()}); {self._linear_line}")

    def _lend_words(self) -> str:
        lend = self.lend_threads()
        return (f"; while a trainer waits for data, each rollout worker on its host runs {lend} more "
                "(cluster.lend_idle_cores)") if lend else ""

    def _plan_per_host(self) -> bool:
        c = self.spec.cluster
        return c.scheduler_address is not None and c.torch_threads == "auto" and c.processes

    def _place_cpu_on_cluster(self) -> dict[str, int]:
        """`torch_threads: auto` on a cluster of your own: ask each worker where it runs, and split each host's cores
        among the processes that work at once there (`astratk.cpu.plan_shared_hosts`), the trainers on this host
        included. Sets this process's threads and says the plan; returns each rollout worker's threads."""
        from astratk import cpu

        info = self.client.scheduler_info()["workers"]
        rollout = [a for a, w in info.items() if serves_rollouts(w.get("resources"))]
        facts = self.client.run(cpu.host_facts, workers=rollout) if rollout else {}
        trainer, threads, why = cpu.plan_shared_hosts(cpu.host_facts(), facts, trainers=len(self.spec.policies),
                                                      synchronous=self.spec.dataflow.synchronous)
        torch.set_num_threads(trainer)
        self.trainer_threads = trainer
        here = cpu.host_facts().host
        self.rollout_workers_here = sum(f.host == here for f in facts.values())
        each = sorted(set(threads.values()))
        said = "/".join(map(str, each)) if each else "-"
        self.print(f"CPU: torch threads trainer {trainer}, each rollout worker {said} ({why}{self._lend_words()}); "
                   f"{self._linear_line}")
        return threads

    def _build_models(self) -> None:
        """Every policy's starting model directory (built and warm-started, or from the cache), and every frozen
        model's."""

        for i, p in enumerate(self.spec.policies):
            t = time.perf_counter()
            path = str(ensure_model(p.model, self.spec.env, log=self.print, key=f"policies[{i}].model"))
            self.model_paths[p.policy_id] = path
            self.print(f"model for {p.policy_id!r}: {path} ({time.perf_counter() - t:.0f}s)")
            lines, shown = tool_status(self.spec.env, p.policy_id, path)
            for line in lines:
                self.print(line)
            if shown is not None:
                self.tools_shown[p.policy_id] = shown
        for i, f in enumerate(self.spec.frozen):  # served beside the policies, never trained nor published
            t = time.perf_counter()
            path = str(ensure_model(f.model, self.spec.env, log=self.print, key=f"frozen[{i}].model"))
            check_frozen_model(path, f"frozen[{i}].model")
            self.model_paths[f.name] = path
            self.print(f"frozen model {f.name!r} for role(s) {', '.join(f.roles)}: {path} "
                       f"({time.perf_counter() - t:.0f}s; served on the rollout workers, never trained)")

    def _prepare_weights(self) -> str:
        """The weight store's URL, holding every policy's version 0; or, when resuming, the resumed
        run's store rolled back to the checkpoint's version."""
        from astratk.runtime.deploy import publish_initial
        from astratk.weights.store import WeightStore

        spec = self.spec
        store_url = spec.weights.url or str(self.run_dir / "weights")
        if spec.resume_from:
            [p] = spec.policies  # __init__ refused several
            rp = self.resume_point = find_resume_point(spec, p.policy_id)
            copy_version(WeightStore(rp.store_url), WeightStore(store_url), p.policy_id, rp.step)
            self.print(f"resuming from {rp.checkpoint} (step {rp.step}) and data-layer snapshot "
                       f"{rp.snapshot_url}/{rp.snapshot_name}; weights v{rp.step} copied to {store_url} (the "
                       "resumed run's store is left as it was)")
            return store_url
        for i, p in enumerate(spec.policies):
            publish_initial(WeightStore(store_url), p.policy_id, self.model_paths[p.policy_id],
                            p.model.lora, key=f"policies[{i}].model.lora")
        return store_url

    def _start_cluster(self) -> None:
        """A client of `cluster.scheduler_address`, or of a local cluster started here (adaptive
        when `cluster.autoscale` is set)."""
        spec = self.spec
        if spec.cluster.scheduler_address:
            self.client = connect(spec)
        else:
            from distributed import Client

            self._warm_key = key = warm.layout_key(spec)
            cluster = warm.take(key)
            self.cluster_reused = cluster is not None
            if cluster is None:
                cluster = start_local_cluster(spec, processes=spec.cluster.processes)
            self.cluster = cluster
            planned = set(cluster.worker_spec)
            self._on_exit(lambda: self._give_back_cluster(key, planned))
            # Not the process's default client: several runs may share a process (a notebook), and a default
            # client changes Dask's process-wide scheduler setting, which closing it restores to a stale value
            self.client = Client(cluster, set_as_default=False)
            if self.cluster_reused:
                from astratk.cpu import run_threads

                warm.rethread(self.client, cluster, run_threads(spec).rollout)
            if spec.cluster.autoscale is not None:
                from astratk.runtime.autoscale import WaitFractionAdaptive, WaitFractionMonitor

                self.autoscale = WaitFractionMonitor(spec.cluster.autoscale)
                adaptive = cluster.adapt(Adaptive=WaitFractionAdaptive, monitor=self.autoscale)
                self._on_exit(adaptive.stop)
        self._on_exit(self.client.close)
        if self._warm_key is not None and spec.cluster.keep_warm_s > 0:
            self._on_exit(self._check_workers_clean)  # before the client closes: asks the workers

    def _check_workers_clean(self) -> None:
        """Whether the local cluster may serve the next run: this run ended without an error and no worker has a
        thread of user code it had to abandon (`astratk.rollout.bounded`) still around."""
        if self._exc is not None or self.state == "failed":
            self._cluster_clean = False
            return
        try:
            # a worker that does not answer within 30 s: the cluster is not kept
            counts = self.client.run(abandoned_threads, callback_timeout=30)
            self._cluster_clean = not any(counts.values())
        except Exception:  # noqa: BLE001 - a cluster that cannot answer is not kept
            self._cluster_clean = False

    def _give_back_cluster(self, key: str | None, planned: set[str]) -> None:
        """Close the local cluster, or keep it warm for the next run in this process (`astratk.runtime.warm`)."""
        outcome = warm.give_back(self.cluster, key, self.spec.cluster.keep_warm_s, planned,
                                 reusable=self._cluster_clean)
        if outcome != "closed" and not self.cluster_reused:
            self.print(f"local cluster {outcome}")

    def _deploy(self, ctx: Any) -> None:
        """The data layer (restored from the resume point's snapshot when resuming) and the
        acquisition loop, published on the scheduler under the deployment's name for trainer
        processes to attach."""
        from astratk.runtime.deploy import deploy

        spec, rp = self.spec, self.resume_point
        self.deployment_name = self._name or f"{spec.name}-{ctx.run_id}"
        self.snapshot_url = spec.dataflow.snapshot.url or str(self.run_dir / "datalayer")
        restore = (rp.snapshot_url, rp.snapshot_name) if rp else None
        self.deployment = deploy(ctx, self.client, timeout_s=spec.cluster.startup_timeout_s,
                                 snapshot_url=self.snapshot_url, restore=restore,
                                 name=self.deployment_name)
        self.deployment.store.keep_last = spec.weights.keep_last  # only the publisher prunes
        self._on_exit(self.deployment.stop)

    def _start_evaluator(self, ctx: Any) -> None:
        from astratk.runtime.evaluation import Evaluator

        policies = [p.policy_id for p in self.spec.policies]
        self.evaluator = Evaluator(self.client, ctx, policies, self.deployment.store)
        self.evaluator.on_record = self._print_eval
        self._on_exit(self.evaluator.stop)

