"""What a `Session` reports while it runs: run-level metrics to the in-process trainer's loggers, the partial
metrics file written every `metrics_every_s`, the printed evaluation and status lines. Mixed into `Session`
(`astratk.runtime.session`); loggers and printed lines are views, so a failure here is reported once and never stops
the run (metrics.nc holds everything).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from astratk.training.loggers import log_run_metrics


class LiveMetrics:
    """`Session`'s logging and printing; the attributes it reads are set by `Session.__init__` and its set-up."""

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

    def attach_loggers(self, loggers: list[Any]) -> None:
        """The in-process trainer's loggers, once it is built; they get the evaluations that finished before (the
        starting model's is evaluated while the trainer starts, and may finish first)."""
        with self._loggers_lock:
            self.trainer_loggers = list(loggers)
            early, self._early_evals = self._early_evals or [], None
        for r in early:
            self._log_eval(r)

    def _log_eval(self, r: dict[str, float]) -> None:
        if len(self.spec.policies) != 1:
            return
        with self._loggers_lock:
            if self._early_evals is not None:  # no trainer here yet: kept for its loggers (a trainer elsewhere: none)
                self._early_evals.append(r)
                return
        pid = self.spec.policies[0].policy_id
        keys = [k for k in r if k in ("accuracy", "sampled_accuracy") or k.startswith(("accuracy_", "pass_at_"))]
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
        when += _lost_episodes(r)
        if len(self.spec.policies) == 1:
            self.print(f"held-out accuracy v{int(r['version'])}: {r['accuracy']:.3f} on "
                       f"{int(r['n'])} tasks{when}")
            return
        versions = ", ".join(f"{p.policy_id} v{int(r.get(f'version_{p.policy_id}', -1))}"
                             for p in self.spec.policies)
        roles = "  ".join(f"{role} {r[f'accuracy_{role}']:.3f}"
                          + (f" (balanced {r[f'balanced_accuracy_{role}']:.3f})" if f"balanced_accuracy_{role}" in r
                             else "")
                          for role in self.spec.env.roles
                          if f"accuracy_{role}" in r) or f"accuracy {r['accuracy']:.3f}"
        self.print(f"held-out ({versions}): {roles} on {int(r['n'])} tasks{when}")

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

    def _status(self, policy_id: str) -> str:
        """The in-process trainer's progress line: the newest accuracy, the buffer, the drops, the scaling."""
        evals = [r for r in self.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        acc = f"acc {evals[-1]['accuracy']:.3f}@v{int(evals[-1]['version'])}" if evals else ""
        m = self.deployment.datalayer.metrics()
        k = f"data/{policy_id}/"
        scaling = (f"  rollout workers {len(self.cluster.pool())} "
                   f"(wait fraction {self.autoscale.fraction:.2f})" if self.autoscale else "")
        return (f"{acc}  buffer {m.get(k + 'buffer_groups', 0):.0f}  "
                f"stale-drop {m.get(k + 'groups_dropped_stale', 0):.0f}  "
                f"zero-var {m.get(k + 'groups_dropped_zero_variance', 0):.0f}{scaling}")


def _lost_episodes(r: dict[str, float]) -> str:
    """What an evaluation line adds when some held-out episodes ended without an answer and were scored 0."""
    late, long_ = int(r.get("episodes_timed_out", 0) or 0), int(r.get("episodes_too_long", 0) or 0)
    parts = ([f"{late} ran past rollout.episode_timeout_s (raise it, or give the workers more cores)"] if late else []) \
        + ([f"{long_} had a prompt longer than the model's context"] if long_ else [])
    return f"; scored 0 without an answer: {', '.join(parts)}" if parts else ""
