"""How a `Session` drives its run once set up: `train()` and `serve()` share one loop (`_drive`), the same for every
policy, that reads like the data path; the trainers it waits for (in this process or as trainer processes); pause,
resume and stop. Mixed into `Session` (`astratk.runtime.session`), whose state it reads; a new way to train a run
builds a `Fit` in `_build_trainers` and leaves the loop alone.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from astratk import idle_cores
from astratk.runtime.starvation import StarvationMonitor
from astratk.runtime.trainers import TrainerProcesses, trainer_dir
from astratk.spec import NothingToTrain, RunSpec

DETACHED_TIMEOUT_S = 600.0  # a deployment ends this long after its last trainer ended, if none attached since

# Runs a run's trainers to their end; per policy, what its fit reported (`build.fit_result`).
Fit = Callable[[], dict[str, dict[str, Any]]]


def _quiet_lightning() -> None:
    """Lightning sets its logger to INFO when imported (GPU/TPU availability, tips); a run prints
    its own progress."""

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    # torch 2.13 + Lightning 2.6 warn about LeafSpec on every fit
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")


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


class Drive:
    """`Session`'s run loop and controls; the attributes it reads are set by `Session.__init__` and its set-up."""

    spec: RunSpec
    trainer_threads: int | None = None  # torch threads of the run's trainers (`Session._place_cpu`)
    rollout_workers_here: int = 0  # rollout workers on this host (a waiting trainer lends them its threads)
    idle_dir: Path | None = None  # where a waiting trainer says so on this host (`astratk.idle_cores`)
    nothing_to_train: str | None = None  # set when the run finds it cannot train anything (the line that says why)

    def lend_threads(self) -> int:
        """Threads a waiting trainer of this run lends to each rollout worker on this host (`astratk.idle_cores`)."""
        return idle_cores.lend_per_worker(self.spec, self.trainer_threads or 0, self.rollout_workers_here)

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
        self.print(f"evaluating {what} (v{self._first_version()}) on the held-out split once the first step is done "
                   "(its rollouts come first)")
        return self._drive(self._build_trainers)

    def serve(self, poll_s: float = 5.0, until_versions: dict[str, int] | None = None,
              detached_timeout_s: float = DETACHED_TIMEOUT_S) -> dict[str, Any]:
        """`astratk deploy`: acquire and evaluate for trainers that attach from elsewhere
        (`astratk train fit`), until every policy has published its last version
        (`trainer.max_steps // publish_every`, or `until_versions`), every policy's trainer has ended and none
        attached for `detached_timeout_s` seconds since, or the process is interrupted (Ctrl-C, SIGTERM). Prints the
        attach commands, a status line every `poll_s` seconds, and one line when a trainer attaches or ends."""
        target = until_versions or {p.policy_id: p.trainer.max_steps // p.trainer.publish_every
                                    for p in self.spec.policies}
        address = self.client.scheduler.address
        self.print(f"deployment {self.deployment_name!r} is serving on {address}; attach a trainer "
                   "per policy with:")
        for p in self.spec.policies:
            self.print(f"  astratk train fit --run_config {self.run_dir / 'config.yaml'} "
                       f"--policy_id {p.policy_id} --deployment {self.deployment_name} "
                       f"--scheduler {address}")
        summary = self._drive(lambda: functools.partial(self._wait_for_versions, target, poll_s, detached_timeout_s))
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
            # The first evaluation overlaps training: it starts once the first step is done (or training has
            # stopped), so the first step's rollouts do not wait for it on the rollout workers; it evaluates the
            # stored first version whenever it runs.
            first = self._first_version()
            first_eval = self.evaluator.evaluate_in_background(first, timeout_s=self._first_eval_timeout())
            fit = trainers()
            t0 = time.time()
            self.evaluator.train_t0 = t0
            self.evaluator.start(evaluated=dict.fromkeys((p.policy_id for p in self.spec.policies), first),
                                 after=first_eval)
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
            if self.nothing_to_train is not None:
                raise NothingToTrain(self.nothing_to_train)
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
                                 greedy=self._greedy_accuracy, tools=getattr(self, "tools_shown", {}),
                                 busy=self.evaluator.running, on_nothing=self._nothing_to_train).start()

    def _nothing_to_train(self, line: str) -> None:
        """The run cannot train anything (`starvation.nothing_to_train`): stop the trainers (their wait for a batch ends
        with it), and let `_drive` end the run with `NothingToTrain`, which carries the line."""
        self.nothing_to_train = line
        self.request_stop()

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

    def _build_trainers(self) -> Fit:
        """One policy trains in this process; several train as one `astratk train fit` process
        each, attached to this deployment."""
        if len(self.spec.policies) == 1:
            return self._trainer_here(self.spec.policies[0].policy_id)

        from astratk.runtime.pools import tls_environ

        procs = TrainerProcesses(self.spec, self.run_dir, self.deployment_name,
                                 self.client.scheduler.address, self.print, threads=self.trainer_threads,
                                 lend=self.lend_threads(),
                                 environ=tls_environ(getattr(self.cluster, "tls", None)))
        return procs.run

    def _trainer_here(self, policy_id: str) -> Fit:
        """The policy's trainer in this process (`astratk.training.build`), continuing from the
        resume point's checkpoint when resuming."""
        from astratk.training import build

        _quiet_lightning()
        model_path = self.model_paths[policy_id]
        stream = build.group_stream(self.spec, policy_id, self.deployment.datalayer, model_path)
        lend = self.lend_threads()
        stream.idle_marker = idle_cores.IdleMarker(self.idle_dir, lend) if lend and self.idle_dir else None
        self.stream = stream
        feed = self._autoscale_feed(policy_id, stream) if self.autoscale else None
        trainer = build.build_trainer(
            self.spec, policy_id, model_path=model_path, stream=stream, store=self.deployment.store,
            run_dir=self.run_dir, stop_file=trainer_dir(self.run_dir, policy_id) / "STOP",
            printer=self.print, status=lambda: self._status(policy_id), extra=feed)
        self.recorders[policy_id] = trainer.recorder
        self.attach_loggers(trainer.trainer.loggers)
        ckpt = self.resume_point.checkpoint if self.resume_point else None
        return lambda: {policy_id: trainer.fit(ckpt)}

    def _wait_for_versions(self, target: dict[str, int], poll_s: float,
                           detached_timeout_s: float = DETACHED_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """`serve`'s trainers run elsewhere: print each policy's progress every `poll_s` seconds
        until every policy has published its `target` version, every trainer has ended and none attached for
        `detached_timeout_s` seconds, or SIGTERM or Ctrl-C. Says once when a policy's trainer attaches, and once
        when it ends (at which step, and what happens next). Their step rows stay with their jobs."""
        stop = threading.Event()
        said: dict[str, float] = {}  # policy -> the trainer state last said (1 attached, 0 ended)
        all_ended: float | None = None  # time.monotonic() since when every policy's trainer has ended
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
                    self._say_trainers(m, versions, target, said, detached_timeout_s)
                    if all(said.get(pid) == 0.0 for pid in target):
                        all_ended = time.monotonic() if all_ended is None else all_ended
                        if time.monotonic() - all_ended >= detached_timeout_s:
                            self.print(f"no trainer attached in the {detached_timeout_s:.0f}s since the last one "
                                       "ended: ending the deployment")
                            break
                    else:
                        all_ended = None
        except KeyboardInterrupt:
            self.print("interrupted: stopping the deployment")
        return {}

    def _say_trainers(self, m: dict[str, float], versions: dict[str, int], target: dict[str, int],
                      said: dict[str, float], detached_timeout_s: float) -> None:
        """One line per change of a policy's trainer (attached 1, ended 0: `DataLayer.trainer_attached` and
        `trainer_detached`); `said` keeps what was said last, per policy."""
        for pid, last in target.items():
            state = m.get(f"data/{pid}/trainer_attached")
            if state is None or said.get(pid) == state:
                continue
            said[pid] = state
            if state:
                self.print(f"policy {pid!r}: a trainer attached (v{versions[pid]})")
                continue
            step = int(m.get(f"data/{pid}/trainer_detached_step", 0))
            self.print(f"[detached] policy {pid!r}: its trainer ended after step {step} (v{versions[pid]} of {last}); "
                       f"the deployment keeps serving: attach another with the command above, or it ends "
                       f"{detached_timeout_s:.0f}s after the last trainer ended (astratk deploy --detached_timeout_s)")

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

