"""Held-out evaluation at regular wall-clock intervals, as Dask tasks on rollout workers.

Each evaluation runs the env's held-out tasks greedily at one published version on the service's separate eval
engine. Its record keeps the version's publication time, so "training time at which accuracy first reached X" is
measured from when those weights existed, not from when the evaluation happened to finish.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import uuid
from typing import Any

from astratk.records import RunContext
from astratk.rollout.tasks import EVAL_STARTED, evaluate_task
from astratk.weights.store import WeightStore


class Evaluator:
    """Evaluates `policy_ids` together (each at its own version, roles routed as in the run): one policy in a
    single-policy run, every policy of a workflow in a multi-policy run. With `dataflow.version_barrier` set, a
    periodic evaluation pairs versions no further apart than the barrier allows (0: equal versions), the newest such
    set; without it, each policy's newest. Records carry `version` (the first policy's) and `version_<policy>`."""

    def __init__(self, client: Any, ctx: RunContext, policy_id: str | list[str], store: WeightStore) -> None:
        self.client = client
        self.ctx = ctx
        self.policy_ids = [policy_id] if isinstance(policy_id, str) else list(policy_id)
        self.policy_id = self.policy_ids[0]
        self.store = store
        self.espec = ctx.spec.eval
        self.records: list[dict[str, float]] = []
        self.train_t0: float | None = None  # time.time() when training started
        self.on_record = None  # optional callable(record) for live progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._evaluated: dict[str, int] = {}  # versions evaluated before the periodic loop started
        self._after: concurrent.futures.Future | None = None  # what the periodic loop waits for before its first
        # evaluations in flight by token: (which versions, time.monotonic() they were submitted, or started running)
        self._running: dict[str, tuple[str, float]] = {}
        self._abandoned: set[str] = set()  # tokens given up (`abandon`)
        self._started_tokens: set[str] = set()  # tokens seen started (`EVAL_STARTED`)

    def evaluate(self, version: int | dict[str, int | None] | None = None, *, priority: int = 100,
                 timeout_s: float | None = None) -> dict[str, float]:
        """Evaluate now, blocking; the record is kept and returned. `version`: one version for every policy, a
        {policy: version} mapping, or None for whatever version is newest when the task starts on its worker (it may
        queue behind a rollout chunk meanwhile, and pinning a version at submission could see it pruned from the
        store by then). `priority`: Dask's; 100 runs before queued rollout chunks, 0 after the ones queued already.

        Two bounds: the evaluation may run `eval.timeout_s` on its worker (counted from when it starts there, which
        it tells the scheduler: `EVAL_STARTED`), and the whole wait, its time queued behind rollout chunks included,
        is at most `timeout_s` (default `eval.timeout_s` + `rollout.episode_timeout_s`: a chunk ahead of it ends
        within one episode's bound). An evaluation given up is cancelled (Dask forgets it; a worker thread already
        running it ends on its own) and leaves no record."""
        versions = version if isinstance(version, dict) else dict.fromkeys(self.policy_ids, version)
        # the frozen models the episodes call are served where they run, as in the run's rollouts
        resources = {f"rollout_{p}": 1 for p in [*self.policy_ids, *(f.name for f in self.ctx.spec.frozen)]}
        token = uuid.uuid4().hex
        future = self.client.submit(evaluate_task, self.ctx, versions, self.espec.max_tasks, self.espec.pass_k, token,
                                    resources=resources, priority=priority, pure=False)
        run_s = self.espec.timeout_s
        wait_s = self.default_wait_s() if timeout_s is None else timeout_s
        which = ", ".join(f"{p} {'newest' if v is None else f'v{v}'}" for p, v in versions.items())
        submitted = time.monotonic()
        with self._lock:
            self._running[token] = (which, submitted)
        try:
            out = self._wait(future, token, which, submitted, run_s, wait_s)
        finally:
            with self._lock:
                self._running.pop(token, None)
                self._abandoned.discard(token)
        t0 = self.train_t0
        record = {**out, "evaluated_at": time.time(),
                  # weights published before training began (v0) existed at its start: 0, not a negative time
                  "train_time_s": max(0.0, out["published_at"] - t0) if t0 is not None else float("nan")}
        with self._lock:
            self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        return record

    def default_wait_s(self) -> float:
        """The longest wait for one evaluation, queued and running: `eval.timeout_s` + `rollout.episode_timeout_s`."""
        episode = self.ctx.spec.rollout.episode_timeout_s
        return self.espec.timeout_s + (episode if episode is not None else self.espec.timeout_s)

    def _wait(self, future: Any, token: str, which: str, submitted: float, run_s: float, wait_s: float
              ) -> dict[str, float]:
        """The evaluation's result, within its two bounds (`evaluate`); polls whether it started every second."""
        started: float | None = None
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                pass
            now = time.monotonic()
            if started is None and self._started(token):
                started = now
                with self._lock:
                    if token in self._running:
                        self._running[token] = (which, now)  # `running()` then says how long it has run
            abandoned = token in self._abandoned
            over_run = started is not None and now - started > run_s
            if abandoned or over_run or now - submitted > wait_s:
                future.cancel()
                queued = (started if started is not None else now) - submitted
                ran = f"ran {now - started:.0f}s" if started is not None else "had not started"
                why = ("given up: the run is ending" if abandoned else
                       f"more than eval.timeout_s ({run_s:.0f}s) on its worker" if over_run else
                       f"more than {wait_s:.0f}s in all (eval.timeout_s + rollout.episode_timeout_s for the chunks "
                       "ahead of it)")
                raise TimeoutError(f"held-out evaluation of {which}: {why}; it queued {queued:.0f}s behind rollout "
                                   f"chunks and {ran}")

    def _started(self, token: str) -> bool:
        """Whether the evaluation `token` has started on its worker (it logs `EVAL_STARTED` as it starts)."""
        if token in self._started_tokens:
            return True
        try:
            events = self.client.get_events(EVAL_STARTED)
        except Exception:  # noqa: BLE001 - a client without events (tests' fakes): count from submission
            return True
        self._started_tokens.update(msg for _, msg in events if isinstance(msg, str))
        return token in self._started_tokens

    def abandon(self) -> None:
        """Give up the evaluations in flight: each is cancelled and raises in its caller, leaving no
        record and no line (a run ending without them)."""
        with self._lock:
            self._abandoned.update(self._running)

    def running(self) -> str | None:
        """The held-out evaluations in flight, in words (which versions, for how long, on how many tasks), or None."""
        with self._lock:
            running = list(self._running.values())
        if not running:
            return None
        now = time.monotonic()
        return "; ".join(f"{which} for {now - t0:.0f}s" for which, t0 in running) + (
            f" on {self.espec.max_tasks} held-out tasks")

    def evaluate_in_background(self, version: int, timeout_s: float, start_after_s: float | None = None
                               ) -> concurrent.futures.Future:
        """`evaluate(version)` on a thread, once every policy has published a version past `version` (its first
        step is done), training stops, or `start_after_s` seconds have passed (None: no such limit), whichever comes
        first: the evaluation runs on the rollout workers, and before then it would hold up the rollouts of the
        first step. (It once started after a minute at the latest; where a first step takes minutes, a real model
        on a CPU, that put the whole evaluation into the first step's rollouts: a 300 s tool-agent run then made no
        step at all.) The future holds the record (or the error)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def stepped() -> bool:
            refs = [self.store.latest(pid) for pid in self.policy_ids]
            return all(ref is not None and ref.version > version for ref in refs)

        def run() -> None:
            try:
                deadline = time.monotonic() + (math.inf if start_after_s is None else start_after_s)
                while time.monotonic() < deadline and not self._stop.is_set() and not stepped():
                    time.sleep(0.25)
                future.set_result(self.evaluate(version, timeout_s=timeout_s))
            except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(e)

        threading.Thread(target=run, name="astratk-eval-first", daemon=True).start()
        return future

    def start(self, evaluated: dict[str, int] | None = None, after: concurrent.futures.Future | None = None
              ) -> Evaluator:
        """Evaluate periodically from now on; `evaluated`: versions already evaluated (or being evaluated). With
        `after` (the first evaluation's future), the first periodic one waits until it is done: both would run on the
        same rollout workers, and the records (and the loggers' rows) then come in version order."""
        self._evaluated = dict(evaluated or {})
        self._after = after
        self._thread = threading.Thread(target=self._loop, name="astratk-eval", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def due_versions(self) -> dict[str, int] | None:
        """The versions the next periodic evaluation should use, or None when nothing is published yet."""
        latest = {}
        for pid in self.policy_ids:
            ref = self.store.latest(pid)
            if ref is None:
                return None
            latest[pid] = ref.version
        barrier = self.ctx.spec.dataflow.version_barrier
        if barrier is not None and len(latest) > 1:  # no further apart than the barrier: the trailing policy + b
            low = min(latest.values())
            latest = {pid: min(v, low + barrier) for pid, v in latest.items()}
        return latest

    def _loop(self) -> None:
        while self._after is not None and not self._after.done():
            if self._stop.wait(0.25):
                return
        last = {pid: max((int(r.get(f"version_{pid}", r["version"])) for r in self.records),
                         default=self._evaluated.get(pid, -1))
                for pid in self.policy_ids}
        every = self.espec.every_versions
        last_time = time.monotonic()
        poll_s = min(1.0, self.espec.interval_s) if every is not None else self.espec.interval_s  # store reads
        while not self._stop.wait(poll_s):
            due = self.due_versions()
            if due is None or due == last:
                continue
            by_time = time.monotonic() - last_time >= self.espec.interval_s
            by_version = every is not None and max(due[p] - last[p] for p in due) >= every
            if not (by_time or by_version):
                continue
            last_time = time.monotonic()
            try:
                record = self.evaluate(due if len(due) > 1 or every is not None else None)
                last = {pid: int(record.get(f"version_{pid}", record["version"])) for pid in self.policy_ids}
            except Exception as e:  # noqa: BLE001 - a failed periodic eval is reported, and the next interval tries again
                with self._lock:
                    self.records.append({"version": float(due[self.policy_id]), "accuracy": float("nan"),
                                         "error": 1.0, "evaluated_at": time.time(), "train_time_s": float("nan")})
                last = due
                print(f"held-out evaluation of {due} failed: {e!r}")


def per_policy(records: list[dict[str, float]], spec: Any) -> dict[str, list[dict[str, float]]]:
    """A multi-policy evaluation's records as each policy's rows: `version` = that policy's version, `accuracy` =
    the mean accuracy of the roles it plays (the first role's when it plays them all)."""
    roles = spec.env.roles
    out: dict[str, list[dict[str, float]]] = {}
    for p in spec.policies:
        rows = []
        for r in records:
            if r.get("error"):
                continue
            mine = [r[f"accuracy_{role}"] for role in p.roles if f"accuracy_{role}" in r]
            acc = sum(mine) / len(mine) if mine and len(p.roles) < len(roles) else r.get("accuracy", float("nan"))
            others = {f"{kind}accuracy_{role}" for role in roles if role not in p.roles
                      for kind in ("", "balanced_")} if len(p.roles) < len(roles) else set()
            rows.append({**{k: v for k, v in r.items() if k not in others},  # its own roles' accuracies only
                         "version": float(r.get(f"version_{p.policy_id}", r["version"])), "accuracy": acc})
        out[p.policy_id] = sorted(rows, key=lambda x: (x["version"], x["evaluated_at"]))
    return out
