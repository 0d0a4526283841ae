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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import re
import signal
import threading
import time
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from astratk.config import read_yaml
from astratk.models import ensure_model
from astratk.records import Drop, RunContext
from astratk.runtime.cluster import connect, start_local_cluster
from astratk.runtime.starvation import StarvationMonitor
from astratk.runtime.trainers import TrainerProcesses, trainer_dir
from astratk.spec import RunSpec
from astratk.training.loggers import log_run_metrics

# The quickstart's promise: +15 held-out accuracy points; time-to-target is measured against it.
TARGET_GAIN = 0.15

# Runs a run's trainers to their end; per policy, what its fit reported (`build.fit_result`).
Fit = Callable[[], dict[str, dict[str, Any]]]


def _quiet_lightning() -> None:
    """Lightning sets its logger to INFO when imported (GPU/TPU availability, tips); a run prints
    its own progress."""

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    # torch 2.13 + Lightning 2.6 warn about LeafSpec on every fit
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")


def copy_version(source: Any, target: Any, policy_id: str, version: int) -> None:
    """Publish `source`'s `version` of `policy_id` (and its adapter config) to `target`: a resumed run starts its own
    weight store from its checkpoint's weights, leaving the run it resumes (and the versions that run published
    after the checkpoint) untouched."""
    try:
        state, _ = source.pull(policy_id, None, version)
    except KeyError as e:
        raise ValueError(f"resume_from: the checkpoint's weights (policy {policy_id!r} v{version}) are not in "
                         f"{source.url}: {e.args[0] if e.args else e}") from None
    if (config := source.adapter_config(policy_id)) is not None:
        target.set_adapter_config(policy_id, config)
    target.publish(policy_id, version, state)


def checkpoint_time_used(path: str | Path) -> float:
    """Seconds of training a Lightning checkpoint has used of its `max_time` (its Timer's state; 0 without one).
    Memory-mapped: the weights are not read."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    timer = (state.get("callbacks") or {}).get("Timer") or {}
    return float((timer.get("time_elapsed") or {}).get("train", 0.0))


def same_store(a: str, b: str) -> bool:
    """Whether two weight-store URLs name one place (local paths compared resolved)."""
    import fsspec

    fa, pa = fsspec.core.url_to_fs(a)
    fb, pb = fsspec.core.url_to_fs(b)
    if fa.protocol != fb.protocol:
        return False
    if "file" in (fa.protocol if isinstance(fa.protocol, tuple) else (fa.protocol,)):
        return Path(pa).resolve() == Path(pb).resolve()
    return pa.rstrip("/") == pb.rstrip("/")


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: a trainer checkpoint, the weight store it published to, and
    the data-layer snapshot written when the checkpoint's version was published."""

    checkpoint: Path
    step: int
    store_url: str
    snapshot_url: str
    snapshot_name: str


def find_resume_point(spec: RunSpec, policy_id: str) -> ResumePoint:
    """The newest checkpoint of `policy_id` under `spec.resume_from` (a run directory) and its
    matching snapshot; errors name what is missing. Reads only, so validation runs it before a run
    writes anything."""

    import fsspec

    from astratk.dataflow.snapshots import SnapshotStore

    given = Path(spec.resume_from).expanduser().resolve()
    checkpoint = re.compile(r"step=(\d+)\.ckpt")
    if not given.exists():
        raise FileNotFoundError(f"resume_from: {str(given)!r} does not exist; give a run directory "
                                "(runs/<name>-<time>) or one of its checkpoints "
                                f"(<run dir>/checkpoints/{policy_id}/step=K.ckpt)")
    if given.is_file():  # a checkpoint: <run dir>/checkpoints/<policy>/step=K.ckpt
        if (not checkpoint.fullmatch(given.name) or given.parent.name != policy_id
                or given.parent.parent.name != "checkpoints"):
            raise ValueError(f"resume_from: {given} is not a checkpoint of policy {policy_id!r} "
                             "written by a run (expected "
                             f"<run dir>/checkpoints/{policy_id}/step=K.ckpt)")
        ckpts, old = [given], given.parents[2]
    else:
        old = given
        ckpts = sorted((p for p in (old / "checkpoints" / policy_id).glob("step=*.ckpt")
                        if checkpoint.fullmatch(p.name)), key=lambda p: int(p.stem.split("=")[1]))
    if not ckpts:
        raise FileNotFoundError(f"resume_from: no checkpoints in {old / 'checkpoints' / policy_id};"
                                " the run must set policies[*].trainer.checkpoint_every")
    if not zipfile.is_zipfile(ckpts[-1]):  # torch.save's format: a truncated or foreign file is not
        raise ValueError(f"resume_from: {ckpts[-1]} is not a trainer checkpoint torch can load "
                         "(truncated, or another kind of file); resume from an earlier one")
    step = int(ckpts[-1].stem.split("=")[1])
    config = old / "config.yaml"
    saved = read_yaml(config) if config.exists() else {}
    if not isinstance(saved, dict):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors
            f"resume_from: {config} is not a run's config (a mapping of RunSpec fields), it holds "
            f"a {type(saved).__name__}")
    store_url = (saved.get("weights") or {}).get("url") or str(old / "weights")
    snapshot = (saved.get("dataflow") or {}).get("snapshot") or {}
    snapshot_url = snapshot.get("url") or str(old / "datalayer")
    fs, root = fsspec.core.url_to_fs(snapshot_url)
    if not fs.exists(f"{root}/index.json"):  # SnapshotStore would make the directory: look first
        raise FileNotFoundError(f"resume_from: no data-layer snapshots at {snapshot_url} (no "
                                "index.json); a checkpoint resumes with the snapshot its run wrote")
    entry = SnapshotStore(snapshot_url).at_checkpoint(policy_id, step)
    return ResumePoint(ckpts[-1], step, store_url, snapshot_url, entry.name)


def _quiet_dask() -> None:
    logging.getLogger("distributed").setLevel(logging.WARNING)


@contextlib.contextmanager
def _sigterm_sets(stop: threading.Event) -> Iterator[None]:
    """Inside: SIGTERM sets `stop` instead of ending the process (in the main thread only, the one
    that can install a handler)."""

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Session:
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
        self.resume_point: ResumePoint | None = None  # with resume_from (one policy only)
        self.stream: Any = None  # the in-process trainer's GroupStream (single-policy runs)
        self.recorders: dict[str, Any] = {}  # the in-process trainer's StepRecorder: its rows grow as it trains
        self.trainer_loggers: list[Any] = []  # the in-process trainer's Lightning loggers (evaluations go there too)
        self._logger_error: str | None = None
        self.metrics_writes = 0  # partial metrics.nc files written while training (metrics_every_s)
        self.trainer_error: BaseException | None = None  # what the in-process trainer raised, if it did
        self.starvation: Any = None  # the StarvationMonitor while training (astratk.runtime.starvation)
        # per policy: the groups its trainer trained on, in order
        self.group_ids: dict[str, list[str]] = {}
        self.state = "starting"  # starting | training | paused | finished | failed
        self._name = deployment_name
        self._closers: list[Callable[[], Any]] = []  # run on exit, the last registered first

    # --------------------------------------------------------------------------------- set-up
    def __enter__(self) -> Session:  # noqa: PYI034 - typing.Self needs Python 3.11
        try:
            return self._set_up()
        except BaseException:
            # `with` runs no __exit__ when __enter__ raises: close what set-up started (a cluster, a deployment)
            self.__exit__(None, None, None)
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

        ctx = RunContext(run_id=uuid.uuid4().hex[:12], spec=self.spec, model_paths=dict(self.model_paths),
                         store_url=store_url, cpu_linear=cpu.linear_backend())  # one choice for every process
        self._deploy(ctx)
        workers = len(self.client.scheduler_info()["workers"])
        dashboard = self.client.dashboard_link if self.spec.cluster.dashboard else "off"
        self.print(f"cluster up with {workers} workers ({time.perf_counter() - t:.0f}s); "
                   f"dashboard: {dashboard}")
        self._start_evaluator(ctx)
        return self

    def __exit__(self, *exc: object) -> None:
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
        cpu.set_linear_backend(self.spec.cluster.cpu_linear)
        linear = cpu.linear_backend()
        speed = cpu.onednn_speedup() if self.spec.cluster.cpu_linear == "auto" else None
        why = f" ({speed:.1f}x torch's BLAS here)" if speed else ""
        self.print(f"CPU: torch threads trainer {plan.trainer}, each rollout worker {plan.rollout} ({plan.reason}); "
                   f"Linear layers: {linear}{why}")

    def _build_models(self) -> None:
        """Every policy's starting model directory (built and warm-started, or from the cache)."""

        for i, p in enumerate(self.spec.policies):
            t = time.perf_counter()
            path = str(ensure_model(p.model, self.spec.env, log=self.print, key=f"policies[{i}].model"))
            self.model_paths[p.policy_id] = path
            self.print(f"model for {p.policy_id!r}: {path} ({time.perf_counter() - t:.0f}s)")

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


            self.cluster = cluster = start_local_cluster(spec, processes=spec.cluster.processes)
            self._on_exit(cluster.close)
            # Not the process's default client: several runs may share a process (a notebook), and a default
            # client changes Dask's process-wide scheduler setting, which closing it restores to a stale value
            self.client = Client(cluster, set_as_default=False)
            if spec.cluster.autoscale is not None:
                from astratk.runtime.autoscale import WaitFractionAdaptive, WaitFractionMonitor

                self.autoscale = WaitFractionMonitor(spec.cluster.autoscale)
                adaptive = cluster.adapt(Adaptive=WaitFractionAdaptive, monitor=self.autoscale)
                self._on_exit(adaptive.stop)
        self._on_exit(self.client.close)

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

    def _log(self, metrics: dict[str, float], step: int, flush: bool = False) -> None:
        """Send run-level metrics to the in-process trainer's loggers; a logger that fails is reported once and
        never stops the run."""
        if not self.trainer_loggers:
            return

        try:
            log_run_metrics(self.trainer_loggers, metrics, step, flush=flush)
        except Exception as e:  # noqa: BLE001 - loggers are a view; the run's metrics.nc has everything
            if self._logger_error is None:
                self._logger_error = repr(e)
                self.print(f"a logger refused the run's metrics ({type(e).__name__}: {e}); they stay in metrics.nc")

    def _log_eval(self, r: dict[str, float]) -> None:
        if len(self.spec.policies) != 1:
            return
        pid = self.spec.policies[0].policy_id
        keys = [k for k in r if k == "accuracy" or k.startswith(("accuracy_", "pass_at_"))]
        self._log({f"eval/{pid}/{k}": r[k] for k in keys}, step=int(r["version"]),
                  flush=self.state != "training")

    def _log_counters(self, flush: bool = False) -> None:
        """The data layer's throughput and drop counters, and the rollout services' speed, at the trainer's step."""
        if not self.trainer_loggers:
            return
        data = self.deployment.datalayer.metrics(timeout=10)
        keep = ("samples_received", "groups_received", "groups_admitted", "groups_served", "reward_mean_received",
                "buffer_groups")
        out = {k: v for k, v in data.items()
               if k.startswith("data/") and (k.rsplit("/", 1)[-1] in keep or "dropped" in k)}
        services = self.deployment.acquisition.services.by_service()
        if services:
            for name in ("tasks_per_s", "tokens_per_s"):
                out[f"rollout/{name}"] = float(sum(row.get(name, 0.0) for row in services.values()))
        steps = max((len(rec.rows) for rec in self.recorders.values()), default=0)
        self._log(out, step=steps, flush=flush)

    def _print_eval(self, r: dict[str, float]) -> None:
        self._log_eval(r)
        if int(r["version"]) == self._first_version():
            when = " (the starting weights)"
        elif r["train_time_s"] == r["train_time_s"]:  # NaN before training starts
            when = f" (weights published at {max(0.0, r['train_time_s']):.0f}s of training)"
        else:
            when = ""
        if len(self.spec.policies) == 1:
            self.print(f"held-out accuracy v{int(r['version'])}: {r['accuracy']:.3f} on "
                       f"{int(r['n'])} tasks{when}")
            return
        versions = ", ".join(f"{p.policy_id} v{int(r.get(f'version_{p.policy_id}', -1))}"
                             for p in self.spec.policies)
        roles = "  ".join(f"{role} {r[f'accuracy_{role}']:.3f}" for role in self.spec.env.roles
                          if f"accuracy_{role}" in r) or f"accuracy {r['accuracy']:.3f}"
        self.print(f"held-out ({versions}): {roles} on {int(r['n'])} tasks{when}")

    # --------------------------------------------------------------------------- pause/resume
    def pause(self) -> None:
        """Stop leasing new tasks and serving new batches; work in flight is admitted, trainers
        wait (their batch timeout does not run while paused). Nothing is lost."""
        self.deployment.pause()
        self.deployment.datalayer.set_paused(True)
        self.state = "paused"

    def resume(self) -> None:
        self.deployment.datalayer.set_paused(False)
        self.deployment.resume()
        self.state = "training"

    def request_stop(self) -> None:
        """Trainers finish their current step and stop (a STOP file each: in-process and trainer
        processes alike)."""

        for p in self.spec.policies:
            d = trainer_dir(self.run_dir, p.policy_id)
            d.mkdir(parents=True, exist_ok=True)
            (d / "STOP").touch()
        self.state = "stopping"

    # ---------------------------------------------------------------------------------- drive
    def train(self) -> dict[str, Any]:
        """Train every policy to its `trainer.max_steps` (or until `request_stop`); the summary."""
        several = len(self.spec.policies) > 1
        tiny = all(p.model.path is None for p in self.spec.policies)  # the built-in tiny model is warm-started
        what = ("the resumed policy" if self.resume_point else
                f"the {'warm-start' if tiny else 'starting'} model{'s' if several else ''}")
        self.print(f"evaluating {what} (v{self._first_version()}) on the held-out split, while training starts")
        return self._drive(self._build_trainers)

    def serve(self, poll_s: float = 5.0, until_versions: dict[str, int] | None = None
              ) -> dict[str, Any]:
        """`astratk deploy`: acquire and evaluate for trainers that attach from elsewhere
        (`astratk train fit`), until every policy has published its last version
        (`trainer.max_steps // publish_every`, or `until_versions`) or the process is interrupted
        (Ctrl-C, SIGTERM). Prints the attach commands and a status line every `poll_s` seconds."""
        target = until_versions or {p.policy_id: p.trainer.max_steps // p.trainer.publish_every
                                    for p in self.spec.policies}
        address = self.client.scheduler.address
        self.print(f"deployment {self.deployment_name!r} is serving on {address}; attach a trainer "
                   "per policy with:")
        for p in self.spec.policies:
            self.print(f"  astratk train fit --run_config {self.run_dir / 'config.yaml'} "
                       f"--policy_id {p.policy_id} --deployment {self.deployment_name} "
                       f"--scheduler {address}")
        summary = self._drive(lambda: functools.partial(self._wait_for_versions, target, poll_s))
        # the steps are the trainer jobs' own; their versions show here
        summary["steps"] = summary["final_version"]
        return summary

    def _drive(self, trainers: Callable[[], Fit]) -> dict[str, Any]:
        """The run, the same for every policy: evaluate the first version; build the trainers
        (`trainers()`); fit them while acquisition and periodic evaluation go on; stop both;
        evaluate the last version; collect each policy's step rows, groups and evaluations and the
        run's counters; summarise. A fit that ends early (a starved stream, a diverged policy, an
        exception in the trainer) still reaches the end: its `stop_reason` goes into the summary,
        and an exception is kept in `trainer_error` for the run to raise once its outputs are
        written."""
        self.state = "training"
        try:
            # The first evaluation overlaps training: it starts once the first step is done (or after a minute), so
            # the first step's rollouts do not wait for it on the rollout workers; it evaluates the stored first
            # version whenever it runs.
            first = self._first_version()
            first_eval = self.evaluator.evaluate_in_background(first, timeout_s=self._first_eval_timeout())
            fit = trainers()
            t0 = time.time()
            self.evaluator.train_t0 = t0
            self.evaluator.start(evaluated=dict.fromkeys((p.policy_id for p in self.spec.policies), first))
            writer = self._start_metrics_writer()
            self.starvation = self._start_starvation_monitor()
            try:
                results = fit()
            finally:
                train_time = time.time() - t0
                self.starvation.stop()
                writer()
                self.evaluator.stop()
                self.deployment.acquisition.stop()
            base = self._first_evaluation(first_eval, first)
            errors = [res.pop("error") for res in results.values() if res.get("error") is not None]
            self.trainer_error = errors[0] if errors else None
            final = self._final_evaluation()
            self._collect(results)
            with contextlib.suppress(Exception):  # a view of counters the run has already collected
                self._log_counters(flush=True)
            summary = self._summary(base, final, train_time, results)
        except BaseException:
            self.state = "failed"
            raise
        self.state = "finished"
        return summary

    def _start_starvation_monitor(self) -> Any:
        """Explains, while it happens, a trainer waiting while groups are dropped (`astratk.runtime.starvation`)."""

        streams = {self.spec.policies[0].policy_id: self.stream} if self.stream is not None else {}
        return StarvationMonitor(self.spec, self.deployment.datalayer, self.print, streams=streams,
                                 greedy=self._greedy_accuracy).start()

    def _greedy_accuracy(self, policy_id: str) -> float | None:
        """The newest held-out (greedy) accuracy of a policy, where an evaluation has run."""
        from astratk.runtime.evaluation import per_policy

        records = sorted(self.evaluator.records, key=lambda r: (r["version"], r["evaluated_at"]))
        rows = {policy_id: records} if len(self.spec.policies) == 1 else per_policy(records, self.spec)
        ok = [r["accuracy"] for r in rows.get(policy_id, []) if r.get("accuracy") == r.get("accuracy")]
        return ok[-1] if ok else None

    def _first_eval_timeout(self) -> float:
        """The first evaluation may wait behind training's rollouts: as long as training may last, plus its own
        `eval.timeout_s` (a run without max_time_s: only eval.timeout_s after training, see `_first_evaluation`)."""
        budgets = [p.trainer.max_time_s for p in self.spec.policies]
        if any(b is None for b in budgets):
            return 7 * 24 * 3600.0  # bounded by `_first_evaluation`'s own wait once training is over
        return max(budgets) + 2 * self.spec.eval.timeout_s

    def _first_evaluation(self, future: Any, version: int) -> dict[str, float]:
        """The first version's evaluation, waited for once training is over (eval.timeout_s at most); a failed one is
        recorded with accuracy NaN, so that the run still writes what it gathered."""

        try:
            return future.result(timeout=self.spec.eval.timeout_s)
        except concurrent.futures.TimeoutError:
            why = f"not finished {self.spec.eval.timeout_s:.0f}s after training (eval.timeout_s)"
        except Exception as e:  # noqa: BLE001 - reported; the run's outputs matter more
            why = f"{type(e).__name__}: {e}"
        self.print(f"held-out evaluation of the first version (v{version}) failed: {why}")
        return {"version": float(version), "accuracy": float("nan"), "n": 0.0, "error": 1.0,
                "evaluated_at": time.time(), "train_time_s": float("nan")}

    def _final_evaluation(self) -> dict[str, float]:
        """The last version's held-out evaluation; a failed one is recorded with accuracy NaN, so
        that the run still writes what it gathered. A periodic evaluation of exactly the newest versions is that
        evaluation already (greedy decoding on the same tasks gives the same accuracy): it is not run twice."""
        newest = {p.policy_id: getattr(self.deployment.store.latest(p.policy_id), "version", None)
                  for p in self.spec.policies}
        for record in reversed(list(self.evaluator.records)):
            if record.get("accuracy") == record.get("accuracy") and all(
                    int(record.get(f"version_{pid}", record["version"])) == v for pid, v in newest.items()):
                return record
        try:
            return self.evaluator.evaluate()
        except Exception as e:  # noqa: BLE001 - reported; the run's outputs matter more
            self.print(f"held-out evaluation of the last version failed: {e}")
            latest = self.deployment.store.latest(self.spec.policies[0].policy_id)
            return {"version": float(latest.version if latest else 0), "accuracy": float("nan"),
                    "n": 0.0, "error": 1.0, "evaluated_at": time.time(), "train_time_s": float("nan")}

    def _first_version(self) -> int:
        """The version training starts from: 0, or the resume point's step (a version per step)."""
        return self.resume_point.step if self.resume_point else 0

    def _build_trainers(self) -> Fit:
        """One policy trains in this process; several train as one `astratk train fit` process
        each, attached to this deployment."""
        if len(self.spec.policies) == 1:
            return self._trainer_here(self.spec.policies[0].policy_id)

        procs = TrainerProcesses(self.spec, self.run_dir, self.deployment_name,
                                 self.client.scheduler.address, self.print)
        return procs.run

    def _trainer_here(self, policy_id: str) -> Fit:
        """The policy's trainer in this process (`astratk.training.build`), continuing from the
        resume point's checkpoint when resuming."""
        from astratk.training import build

        _quiet_lightning()
        model_path = self.model_paths[policy_id]
        stream = build.group_stream(self.spec, policy_id, self.deployment.datalayer, model_path)
        self.stream = stream
        feed = self._autoscale_feed(policy_id, stream) if self.autoscale else None
        trainer = build.build_trainer(
            self.spec, policy_id, model_path=model_path, stream=stream, store=self.deployment.store,
            run_dir=self.run_dir, stop_file=trainer_dir(self.run_dir, policy_id) / "STOP",
            printer=self.print, status=lambda: self._status(policy_id), extra=feed)
        self.recorders[policy_id] = trainer.recorder
        self.trainer_loggers = list(trainer.trainer.loggers)
        ckpt = self.resume_point.checkpoint if self.resume_point else None
        return lambda: {policy_id: trainer.fit(ckpt)}

    def _wait_for_versions(self, target: dict[str, int], poll_s: float
                           ) -> dict[str, dict[str, Any]]:
        """`serve`'s trainers run elsewhere: print each policy's progress every `poll_s` seconds
        until every policy has published its `target` version, or SIGTERM or Ctrl-C. Their step
        rows stay with their jobs."""
        stop = threading.Event()
        try:
            with _sigterm_sets(stop):
                while not stop.wait(poll_s):
                    m = self.deployment.datalayer.metrics()
                    versions = {pid: int(m.get(f"data/{pid}/version", 0)) for pid in target}
                    self.print("  ".join(
                        f"{pid} v{v}/{target[pid]} "
                        f"buffer {m.get(f'data/{pid}/buffer_groups', 0):.0f} "
                        f"served {m.get(f'data/{pid}/groups_served', 0):.0f}"
                        for pid, v in versions.items()))
                    if all(versions[pid] >= target[pid] for pid in target):
                        break
        except KeyboardInterrupt:
            self.print("interrupted: stopping the deployment")
        return {}

    # -------------------------------------------------------------------------------- results
    def partial_metrics(self, timeout_s: float = 10.0) -> Any:
        """The metrics dataset as far as the run has got (attribute `partial` = 1): the in-process trainer's steps
        so far (trainer jobs write theirs at the end), every evaluation, the data layer's counters and drops, the
        rollout services' throughput."""
        from astratk.metrics import build_dataset
        from astratk.runtime.evaluation import per_policy

        pids = [p.policy_id for p in self.spec.policies]
        steps = {pid: list(rec.rows) for pid, rec in self.recorders.items()}
        records = sorted(self.evaluator.records, key=lambda r: (r["version"], r["evaluated_at"]))
        evals = {pids[0]: records} if len(pids) == 1 else per_policy(records, self.spec)
        datalayer = self.deployment.datalayer
        return build_dataset(pids, steps, evals, datalayer.metrics(timeout=timeout_s),
                             attrs={"name": self.spec.name, "partial": 1},
                             services=self.deployment.acquisition.services.by_service(),
                             drops=datalayer.drops(timeout=timeout_s))

    def _start_metrics_writer(self) -> Callable[[], None]:
        """Write `partial_metrics()` to run_dir/metrics.nc every `metrics_every_s` seconds on a thread; returns the
        function that stops it. A failed write is reported once and retried at the next interval."""
        every = self.spec.metrics_every_s
        if every is None:
            return lambda: None
        from astratk.metrics import save

        stop = threading.Event()
        reported: list[str] = []

        def loop() -> None:
            while not stop.wait(every):
                try:
                    save(self.partial_metrics(), self.run_dir / "metrics.nc")
                    self.metrics_writes += 1
                    self._log_counters()
                except Exception as e:  # noqa: BLE001 - the run goes on; the final write is the one that matters
                    if not reported:
                        reported.append(repr(e))
                        self.print(f"metrics.nc not written during training ({type(e).__name__}: {e}); "
                                   f"retrying every {every:g}s, and at the end")

        thread = threading.Thread(target=loop, name="astratk-metrics-writer", daemon=True)
        thread.start()

        def close() -> None:
            stop.set()
            thread.join(timeout=60)

        return close

    def _collect(self, results: dict[str, dict[str, Any]]) -> None:
        from astratk.runtime.evaluation import per_policy

        for pid, res in results.items():
            self.step_rows[pid] = res["rows"]
            self.group_ids[pid] = res["group_ids"]
        if len(self.spec.policies) == 1:  # every record, failed evaluations (accuracy NaN) too
            [p] = self.spec.policies
            self.eval_rows = {p.policy_id: sorted(self.evaluator.records,
                                                  key=lambda r: (r["version"], r["evaluated_at"]))}
        else:  # each policy's version, and the accuracy of the roles it plays
            self.eval_rows = per_policy(self.evaluator.records, self.spec)
        self._collect_counters()

    def _collect_counters(self) -> None:
        from astratk.runtime.acquisition import task_accounting

        data = self.deployment.datalayer.metrics()
        acquisition = self.deployment.acquisition
        # The acquisition loop's counters are the run's (a chunk may serve several policies); the
        # metrics dataset keeps them under the first policy.
        first = self.spec.policies[0].policy_id
        counts = {f"acquisition/{first}/{k.split('/', 1)[1]}": v
                  for k, v in acquisition.counts.items()}
        accounting = {f"acquisition/{k}": v for k, v in task_accounting(data).items()}
        starving = self.starvation.counters() if self.starvation is not None else {}
        self.counters = {**data, **counts, **accounting, **starving}
        self.drops = self.deployment.datalayer.drops()
        self.service_rows = acquisition.services.by_service()
        if acquisition.errors:
            self.print(f"{len(acquisition.errors)} rollout chunk(s) failed; first: "
                       f"{acquisition.errors[0]}")

    def _autoscale_feed(self, policy_id: str, stream: Any) -> Callable[[], dict[str, float]]:
        """Per step: feed the wait-fraction monitor (trainer wait, whole-step wall time, groups
        consumed/produced) and record what the scaler sees in the step's metrics."""
        pid, monitor, last = policy_id, self.autoscale, [time.perf_counter()]

        def feed() -> dict[str, float]:
            now = time.perf_counter()
            monitor.observe_step(stream.last_wait_s, now - last[0])
            last[0] = now
            m = self.deployment.datalayer.metrics()
            # consumed = fresh groups served: replayed ones are not production's
            monitor.observe_datalayer(m, pid)
            return {f"autoscale/{pid}/wait_fraction": monitor.fraction,
                    f"autoscale/{pid}/rollout_workers": float(len(self.cluster.pool()))}

        return feed

    def _status(self, policy_id: str) -> str:
        evals = [r for r in self.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        acc = f"acc {evals[-1]['accuracy']:.3f}@v{int(evals[-1]['version'])}" if evals else ""
        m = self.deployment.datalayer.metrics()
        k = f"data/{policy_id}/"
        scaling = (f"  rollout workers {len(self.cluster.pool())} "
                   f"(wait fraction {self.autoscale.fraction:.2f})" if self.autoscale else "")
        return (f"{acc}  buffer {m.get(k + 'buffer_groups', 0):.0f}  "
                f"stale-drop {m.get(k + 'groups_dropped_stale', 0):.0f}  "
                f"zero-var {m.get(k + 'groups_dropped_zero_variance', 0):.0f}{scaling}")

    def _summary(self, base: dict[str, float], final: dict[str, float], train_time: float,
                 results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The run's numbers. The headline keys are the first policy's (its steps and data wait;
        the evaluations cover every policy); a multi-policy run adds `<policy>_...` keys for each
        policy that trained here."""
        evals = [r for r in self.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        goal = base["accuracy"] + TARGET_GAIN
        reached = sorted((r for r in evals if r["version"] > 0 and r["accuracy"] >= goal),
                         key=lambda r: r["train_time_s"])
        first = self.spec.policies[0].policy_id
        head = results.get(first, {"rows": [], "data_wait_s": 0.0})
        summary = {
            "policy_id": first,
            "model_path": self.model_paths[first],
            "accuracy_before": base["accuracy"],
            "start_version": self._first_version(),  # 0, or the resumed checkpoint's step
            "resumed_from": str(self.resume_point.checkpoint) if self.resume_point else None,
            "accuracy_after": final["accuracy"],
            "accuracy_best": max(r["accuracy"] for r in evals),
            "accuracy_gain": final["accuracy"] - base["accuracy"],
            "target_gain": TARGET_GAIN,
            "time_to_target_s": reached[0]["train_time_s"] if reached else None,
            "final_version": int(final["version"]),
            "steps": len(head["rows"]),
            "train_time_s": train_time,
            "data_wait_s": head["data_wait_s"],
            "data_wait_fraction": head["data_wait_s"] / max(train_time, 1e-9),
            "n_heldout": int(base["n"]),
            **_stop_summary(self.spec, results),
            "starvation": [w["line"] for w in self.starvation.warnings[-10:]] if self.starvation else [],
        }
        if len(self.spec.policies) > 1:
            for p in self.spec.policies:
                if p.policy_id in results:
                    summary.update(self._policy_summary(p.policy_id, results[p.policy_id]))
        return summary

    def _policy_summary(self, pid: str, result: dict[str, Any]) -> dict[str, Any]:
        """One policy's numbers in a multi-policy run's summary: its fit and its evaluations."""
        ok = [r for r in self.eval_rows[pid] if r.get("accuracy") == r.get("accuracy")]
        return {f"{pid}_steps": len(result["rows"]),
                f"{pid}_final_version": int(ok[-1]["version"]) if ok else 0,
                f"{pid}_accuracy_before": ok[0]["accuracy"] if ok else float("nan"),
                f"{pid}_accuracy_after": ok[-1]["accuracy"] if ok else float("nan"),
                f"{pid}_data_wait_s": result["data_wait_s"]}


def _stop_summary(spec: RunSpec, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`stopped_early` (whether a trainer ended before its last step for a reason other than its
    time limit or a stop asked for), `stop_reason` (why, in words; the first policy's that has one)
    and `skipped_steps` (optimiser steps the divergence guard skipped, over every policy)."""
    reasons = [results[p.policy_id].get("stop_reason") for p in spec.policies if p.policy_id in results]
    reason = next((r for r in reasons if r), None)
    skipped = sum(int(res["rows"][-1].get(f"train/{pid}/skipped_steps", 0)) for pid, res in results.items()
                  if res["rows"])
    return {"stopped_early": reason is not None, "stop_reason": reason, "skipped_steps": skipped}
