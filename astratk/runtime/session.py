"""`Session`: the live parts of a local run (models, cluster, deployment, evaluator, trainers), torn down on exit.

`train()` reads like the data path: evaluate v0, start acquisition and periodic evaluation, fit the trainer(s), stop,
evaluate the last version, summarise. One policy trains in this process (a notebook can step through it); several
policies train together, each in its own `astratk train fit` process attached to this deployment by name
(`astratk.training.deployed`), exactly as cluster jobs do.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from astratk.spec import RunSpec

TARGET_GAIN = 0.15  # the quickstart's promise: +15 held-out accuracy points; time-to-target is measured against it


def _quiet_lightning() -> None:
    """Lightning sets its logger to INFO when imported (GPU/TPU availability, tips); a run prints its own progress."""
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")  # torch 2.13 + Lightning 2.6, every fit (TRAPS)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: a trainer checkpoint, the weight store it published to, and the data-layer
    snapshot written when the checkpoint's version was published."""

    checkpoint: Path
    step: int
    store_url: str
    snapshot_url: str
    snapshot_name: str


def find_resume_point(spec: RunSpec, policy_id: str) -> ResumePoint:
    """The newest checkpoint of `policy_id` under `spec.resume_from` (a run directory) and its matching snapshot;
    errors name what is missing."""
    import yaml

    from astratk.dataflow.snapshots import SnapshotStore

    given = Path(spec.resume_from).expanduser().resolve()
    if given.is_file():  # a checkpoint: <run dir>/checkpoints/<policy>/step=K.ckpt
        ckpts, old = [given], given.parents[2]
        if not given.name.startswith("step=") or given.parent.name != policy_id:
            raise ValueError(f"resume_from: {given} is not a checkpoint of policy {policy_id!r} written by a run "
                             f"(expected <run dir>/checkpoints/{policy_id}/step=K.ckpt)")
    else:
        old = given
        ckpts = sorted((old / "checkpoints" / policy_id).glob("step=*.ckpt"),
                       key=lambda p: int(p.stem.split("=")[1]))
    if not ckpts:
        raise FileNotFoundError(f"resume_from: no checkpoints in {old / 'checkpoints' / policy_id}; the run must set "
                                "policies[*].trainer.checkpoint_every")
    step = int(ckpts[-1].stem.split("=")[1])
    saved = yaml.safe_load((old / "config.yaml").read_text()) if (old / "config.yaml").exists() else {}
    store_url = (saved.get("weights") or {}).get("url") or str(old / "weights")
    snapshot_url = ((saved.get("dataflow") or {}).get("snapshot") or {}).get("url") or str(old / "datalayer")
    entry = SnapshotStore(snapshot_url).at_checkpoint(policy_id, step)
    return ResumePoint(ckpts[-1], step, store_url, snapshot_url, entry.name)


def _quiet_dask() -> None:
    import logging

    logging.getLogger("distributed").setLevel(logging.WARNING)


class Session:
    def __init__(self, spec: RunSpec, run_dir: Path, printer: Callable[[str], None],
                 deployment_name: str | None = None) -> None:
        if len(spec.policies) > 1 and spec.resume_from:
            raise ValueError("resume_from: resuming a multi-policy run is not supported yet; resume each policy's "
                             "trainer with `astratk train fit --ckpt_path ...` against a deployment restored from "
                             "its snapshot")
        self.spec = spec
        self.run_dir = run_dir
        self.print = printer
        self.policy = spec.policies[0]
        self.step_rows: dict[str, list[dict[str, float]]] = {}
        self.eval_rows: dict[str, list[dict[str, float]]] = {}
        self.counters: dict[str, float] = {}
        self.service_rows: dict[str, dict[str, Any]] = {}  # per rollout service (worker): throughput, version lag
        self.cluster: Any = None  # the local PoolCluster (None when attached to a scheduler)
        self.autoscale: Any = None  # WaitFractionMonitor when cluster.autoscale is on
        self.model_paths: dict[str, str] = {}
        self.stream: Any = None  # the in-process trainer's GroupStream (single-policy runs)
        self.group_ids: dict[str, list[str]] = {}  # per policy: the groups its trainer trained on, in order
        self.state = "starting"  # starting | training | paused | finished | failed
        self._name = deployment_name
        self._closers: list[Callable[[], Any]] = []

    # ------------------------------------------------------------------------------------------------ set-up
    def __enter__(self) -> Session:  # noqa: PYI034 - typing.Self needs Python 3.11
        from distributed import Client

        from astratk.models import ensure_model
        from astratk.rollout.service import RunContext, _quiet_transformers
        from astratk.runtime.cluster import start_local_cluster
        from astratk.runtime.deploy import deploy, publish_initial
        from astratk.runtime.evaluation import Evaluator
        from astratk.weights.store import WeightStore

        _quiet_transformers()
        _quiet_dask()
        spec, pid = self.spec, self.policy.policy_id
        for p in spec.policies:
            t = time.perf_counter()
            self.model_paths[p.policy_id] = str(ensure_model(p.model, spec.env, log=self.print))
            self.print(f"model for {p.policy_id!r}: {self.model_paths[p.policy_id]} ({time.perf_counter() - t:.0f}s)")
        self.model_path = self.model_paths[pid]
        torch.set_num_threads(spec.cluster.torch_threads)
        rp = self.resume_point = find_resume_point(spec, pid) if spec.resume_from else None
        store_url = rp.store_url if rp else spec.weights.url or str(self.run_dir / "weights")
        if rp:
            WeightStore(store_url).rollback(pid, rp.step)
            self.print(f"resuming from {rp.checkpoint} (step {rp.step}) and data-layer snapshot "
                       f"{rp.snapshot_url}/{rp.snapshot_name}")
        else:
            for p in spec.policies:
                publish_initial(WeightStore(store_url), p.policy_id, self.model_paths[p.policy_id])
        t = time.perf_counter()
        if spec.cluster.scheduler_address:
            from astratk.runtime.cluster import connect  # TLS from cluster.tls or Dask's config

            self.client = connect(spec)
        else:
            self.cluster = cluster = start_local_cluster(spec, processes=spec.cluster.processes)
            self._closers.append(cluster.close)
            self.client = Client(cluster)
            if spec.cluster.autoscale is not None:
                from astratk.runtime.autoscale import WaitFractionAdaptive, WaitFractionMonitor

                self.autoscale = WaitFractionMonitor(spec.cluster.autoscale)
                adaptive = cluster.adapt(Adaptive=WaitFractionAdaptive, monitor=self.autoscale)
                self._closers.insert(0, adaptive.stop)
        self._closers.insert(0, self.client.close)
        ctx = RunContext(run_id=uuid.uuid4().hex[:12], spec=spec, model_paths=dict(self.model_paths),
                         store_url=store_url)
        self.deployment_name = self._name or f"{spec.name}-{ctx.run_id}"
        self.snapshot_url = spec.dataflow.snapshot.url or str(self.run_dir / "datalayer")
        restore = (self.resume_point.snapshot_url, self.resume_point.snapshot_name) if self.resume_point else None
        self.deployment = deploy(ctx, self.client, timeout_s=spec.cluster.startup_timeout_s,
                                 snapshot_url=self.snapshot_url, restore=restore, name=self.deployment_name)
        self.deployment.store.keep_last = spec.weights.keep_last  # only the publisher prunes
        self._closers.insert(0, self.deployment.stop)
        self.print(f"cluster up with {len(self.client.scheduler_info()['workers'])} workers "
                   f"({time.perf_counter() - t:.0f}s); dashboard: {self.client.dashboard_link if spec.cluster.dashboard else 'off'}")
        self.evaluator = Evaluator(self.client, ctx, [p.policy_id for p in spec.policies], self.deployment.store)
        self.evaluator.on_record = self._print_eval
        self._closers.insert(0, self.evaluator.stop)
        return self

    def __exit__(self, *exc: object) -> None:
        for close in self._closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - teardown must run to the end; report what failed
                self.print(f"while shutting down: {e!r}")

    def _print_eval(self, r: dict[str, float]) -> None:
        when = f" (weights published at {r['train_time_s']:.0f}s)" if r["train_time_s"] == r["train_time_s"] else ""
        if len(self.spec.policies) == 1:
            self.print(f"held-out accuracy v{int(r['version'])}: {r['accuracy']:.3f} on {int(r['n'])} tasks{when}")
            return
        versions = ", ".join(f"{p.policy_id} v{int(r.get(f'version_{p.policy_id}', -1))}" for p in self.spec.policies)
        roles = "  ".join(f"{role} {r[f'accuracy_{role}']:.3f}" for role in self.spec.env.roles
                          if f"accuracy_{role}" in r) or f"accuracy {r['accuracy']:.3f}"
        self.print(f"held-out ({versions}): {roles} on {int(r['n'])} tasks{when}")

    # ------------------------------------------------------------------------------------------ pause/resume
    def pause(self) -> None:
        """Stop leasing new tasks and serving new batches; work in flight is admitted, trainers wait (their batch
        timeout does not run while paused). Nothing is lost."""
        self.deployment.pause()
        self.deployment.datalayer.call("set_paused", True)
        self.state = "paused"

    def resume(self) -> None:
        self.deployment.datalayer.call("set_paused", False)
        self.deployment.resume()
        self.state = "training"

    def request_stop(self) -> None:
        """Trainers finish their current step and stop (a STOP file each: in-process and trainer processes alike)."""
        for p in self.spec.policies:
            d = self.run_dir / "trainers" / p.policy_id
            d.mkdir(parents=True, exist_ok=True)
            (d / "STOP").touch()
        self.state = "stopping"

    # ------------------------------------------------------------------------------------------------- train
    def train(self) -> dict[str, Any]:
        self.state = "training"
        try:
            summary = self._train_here() if len(self.spec.policies) == 1 else self._train_in_processes()
        except BaseException:
            self.state = "failed"
            raise
        self.state = "finished"
        return summary

    def _train_here(self) -> dict[str, Any]:
        pid = self.policy.policy_id
        v0 = self.resume_point.step if self.resume_point else 0
        self.print(f"evaluating {'the warm-start model' if not v0 else 'the resumed policy'} (v{v0}) on the held-out "
                   "split...")
        base = self.evaluator.evaluate(v0)
        trainer, module, stream, recorder = self._build_trainer()
        self.stream = stream
        t0 = time.time()
        self.evaluator.train_t0 = t0
        self.evaluator.start()
        try:
            trainer.fit(module, datamodule=self._datamodule,
                        ckpt_path=str(self.resume_point.checkpoint) if self.resume_point else None)
        finally:
            train_time = time.time() - t0
            self.evaluator.stop()
            self.deployment.acquisition.stop()
        final = self.evaluator.evaluate()
        self.step_rows[pid] = recorder.rows
        self.group_ids[pid] = stream.group_ids
        self.eval_rows[pid] = sorted(self.evaluator.records, key=lambda r: (r["version"], r["evaluated_at"]))
        self._collect_counters()
        return self._summary(base, final, train_time, recorder.rows, stream.total_wait_s)

    def _collect_counters(self) -> None:
        from astratk.rollout.acquisition import task_accounting

        data = self.deployment.datalayer.call("metrics")
        self.counters = {**data,
                         **{f"acquisition/{self.policy.policy_id}/{k.split('/', 1)[1]}": v
                            for k, v in self.deployment.acquisition.counts.items()},
                         **{f"acquisition/{k}": v for k, v in task_accounting(data).items()}}
        self.service_rows = self.deployment.acquisition.services.by_service()
        if self.deployment.acquisition.errors:
            self.print(f"{len(self.deployment.acquisition.errors)} rollout chunk(s) failed; first: "
                       f"{self.deployment.acquisition.errors[0]}")

    def serve(self, poll_s: float = 5.0, until_versions: dict[str, int] | None = None) -> dict[str, Any]:
        """`astratk deploy`: acquire and evaluate for trainers that attach from elsewhere (`astratk train fit`),
        until every policy has published its last version (`trainer.max_steps // publish_every`, or
        `until_versions`) or the process is interrupted (Ctrl-C, SIGTERM). Prints the attach command and a status
        line every `poll_s` seconds."""
        import signal

        from astratk.runtime.evaluation import per_policy

        target = until_versions or {p.policy_id: p.trainer.max_steps // p.trainer.publish_every
                                    for p in self.spec.policies}
        self.print(f"deployment {self.deployment_name!r} is serving on {self.client.scheduler.address}; attach "
                   "a trainer per policy with:")
        for p in self.spec.policies:
            self.print(f"  astratk train fit --run_config {self.run_dir / 'config.yaml'} --policy_id {p.policy_id} "
                       f"--deployment {self.deployment_name} --scheduler {self.client.scheduler.address}")
        base = self.evaluator.evaluate(0)
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if threading.current_thread() is \
            threading.main_thread() else None
        t0 = time.time()
        self.evaluator.train_t0 = t0
        self.evaluator.start()
        self.state = "training"
        try:
            while not stop.wait(poll_s):
                m = self.deployment.datalayer.call("metrics")
                versions = {pid: int(m.get(f"data/{pid}/version", 0)) for pid in target}
                self.print("  ".join(f"{pid} v{v}/{target[pid]} buffer {m.get(f'data/{pid}/buffer_groups', 0):.0f} "
                                     f"served {m.get(f'data/{pid}/groups_served', 0):.0f}"
                                     for pid, v in versions.items()))
                if all(versions[pid] >= target[pid] for pid in target):
                    break
        except KeyboardInterrupt:
            self.print("interrupted: stopping the deployment")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            train_time = time.time() - t0
            self.evaluator.stop()
            self.deployment.acquisition.stop()
        final = self.evaluator.evaluate()
        self.eval_rows = per_policy(self.evaluator.records, self.spec)
        self._collect_counters()
        self.state = "finished"
        summary = self._summary(base, final, train_time, [], 0.0)
        summary["steps"] = int(final["version"])
        return summary

    def _train_in_processes(self) -> dict[str, Any]:
        """One `astratk train fit` process per policy, attached to this deployment; their output is relayed with
        the policy's name; each writes its step rows to <run dir>/trainers/<policy>/steps.json at the end."""
        from astratk.runtime.evaluation import per_policy
        from astratk.runtime.trainers import TrainerProcesses

        self.print("evaluating the warm-start models (v0) on the held-out split...")
        base = self.evaluator.evaluate(0)
        procs = TrainerProcesses(self.spec, self.run_dir, self.deployment_name, self.client.scheduler.address,
                                 self.print)
        t0 = time.time()
        self.evaluator.train_t0 = t0
        self.evaluator.start()
        try:
            results = procs.run()
        finally:
            train_time = time.time() - t0
            self.evaluator.stop()
            self.deployment.acquisition.stop()
        final = self.evaluator.evaluate()
        for pid, res in results.items():
            self.step_rows[pid] = res["rows"]
            self.group_ids[pid] = res["group_ids"]
        self.eval_rows = per_policy(self.evaluator.records, self.spec)
        self._collect_counters()
        first = self.policy.policy_id
        summary = self._summary(base, final, train_time, self.step_rows[first], results[first]["data_wait_s"])
        for p in self.spec.policies:
            evals = [r for r in self.eval_rows[p.policy_id] if r.get("accuracy") == r.get("accuracy")]
            summary[f"{p.policy_id}_steps"] = len(self.step_rows[p.policy_id])
            summary[f"{p.policy_id}_final_version"] = int(evals[-1]["version"]) if evals else 0
            summary[f"{p.policy_id}_accuracy_before"] = evals[0]["accuracy"] if evals else float("nan")
            summary[f"{p.policy_id}_accuracy_after"] = evals[-1]["accuracy"] if evals else float("nan")
            summary[f"{p.policy_id}_data_wait_s"] = results[p.policy_id]["data_wait_s"]
        return summary

    def _build_trainer(self) -> tuple[Any, Any, Any, Any]:
        import lightning.pytorch as pl

        from astratk.training.loggers import make_loggers

        _quiet_lightning()
        from transformers import AutoTokenizer

        from astratk.training.data import GroupStream, RolloutDataModule
        from astratk.training.module import PolicyModule
        from astratk.training.publish import WeightPublisher
        from astratk.training.recorder import ProgressPrinter, StepRecorder, StopFile

        spec, p = self.spec, self.policy
        ts = p.trainer
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        stream = GroupStream(self.deployment.datalayer, p.policy_id, tokenizer.pad_token_id,
                             max_steps=ts.max_steps, timeout_s=ts.batch_timeout_s)
        self._datamodule = RolloutDataModule(stream)
        module = PolicyModule(self.model_path, p.loss, policy_id=p.policy_id,
                              lr=ts.lr, weight_decay=ts.weight_decay, temperature=spec.rollout.temperature,
                              aggregation=ts.aggregation, horizon=ts.horizon or spec.rollout.max_new_tokens,
                              corrections=p.corrections, kl_coef=ts.kl_coef, kl_estimator=ts.kl_estimator,
                              entropy_coef=ts.entropy_coef, micro_batch_tokens=ts.micro_batch_tokens)
        recorder = StepRecorder(stream, extra=self._autoscale_feed(stream) if self.autoscale else None)
        callbacks = [WeightPublisher(self.deployment.store, self.deployment.datalayer, p.policy_id,
                                     ts.publish_every), recorder,
                     StopFile(self.run_dir / "trainers" / p.policy_id / "STOP")]
        if ts.checkpoint_every:  # the data layer snapshots itself when this step's version is published
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(dirpath=self.run_dir / "checkpoints" / p.policy_id,
                                             filename="{step}", every_n_train_steps=ts.checkpoint_every,
                                             save_top_k=-1, save_last=False, enable_version_counter=False))
        if spec.progress:
            callbacks.append(ProgressPrinter(recorder, self._status, printer=self.print))
        max_time = datetime.timedelta(seconds=ts.max_time_s) if ts.max_time_s else None
        trainer = pl.Trainer(max_steps=ts.max_steps, max_time=max_time, accelerator="cpu", devices=1,
                             logger=make_loggers(ts.loggers, self.run_dir, "lightning"), callbacks=callbacks,
                             gradient_clip_val=ts.grad_clip or None, enable_checkpointing=bool(ts.checkpoint_every),
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             log_every_n_steps=1)
        return trainer, module, stream, recorder

    def _autoscale_feed(self, stream: Any) -> Callable[[], dict[str, float]]:
        """Per step: feed the wait-fraction monitor (trainer wait, whole-step wall time, groups consumed/produced)
        and record what the scaler sees in the step's metrics."""
        pid, monitor, last = self.policy.policy_id, self.autoscale, [time.perf_counter()]

        def feed() -> dict[str, float]:
            now = time.perf_counter()
            monitor.observe_step(stream.last_wait_s, now - last[0])
            last[0] = now
            m = self.deployment.datalayer.call("metrics")
            monitor.observe_counts(m.get(f"data/{pid}/groups_served", 0.0), m.get(f"data/{pid}/groups_admitted", 0.0))
            return {f"autoscale/{pid}/wait_fraction": monitor.fraction,
                    f"autoscale/{pid}/rollout_workers": float(len(self.cluster.pool()))}

        return feed

    def _status(self) -> str:
        evals = [r for r in self.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        acc = f"acc {evals[-1]['accuracy']:.3f}@v{int(evals[-1]['version'])}" if evals else ""
        m = self.deployment.datalayer.call("metrics")
        pid = self.policy.policy_id
        scaling = (f"  rollout workers {len(self.cluster.pool())} (wait fraction {self.autoscale.fraction:.2f})"
                   if self.autoscale else "")
        return (f"{acc}  buffer {m.get(f'data/{pid}/buffer_groups', 0):.0f}  "
                f"stale-drop {m.get(f'data/{pid}/groups_dropped_stale', 0):.0f}  "
                f"zero-var {m.get(f'data/{pid}/groups_dropped_zero_variance', 0):.0f}{scaling}")

    def _summary(self, base: dict[str, float], final: dict[str, float], train_time: float,
                 rows: list[dict[str, float]], data_wait_s: float) -> dict[str, Any]:
        evals = [r for r in self.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        reached = sorted((r for r in evals if r["version"] > 0 and r["accuracy"] >= base["accuracy"] + TARGET_GAIN),
                         key=lambda r: r["train_time_s"])
        return {
            "policy_id": self.policy.policy_id,
            "model_path": self.model_path,
            "accuracy_before": base["accuracy"],
            "accuracy_after": final["accuracy"],
            "accuracy_best": max(r["accuracy"] for r in evals),
            "accuracy_gain": final["accuracy"] - base["accuracy"],
            "target_gain": TARGET_GAIN,
            "time_to_target_s": reached[0]["train_time_s"] if reached else None,
            "final_version": int(final["version"]),
            "steps": len(rows),
            "train_time_s": train_time,
            "data_wait_s": data_wait_s,
            "data_wait_fraction": data_wait_s / max(train_time, 1e-9),
            "n_heldout": int(base["n"]),
        }
