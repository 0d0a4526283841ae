"""A trainer waiting for data, explained while it happens.

`StarvationMonitor` runs beside a local run's trainers. Every `check_s` seconds it reads the data layer's counters; when
a policy's trainer has waited `after_s` seconds for its batch (the in-process trainer's own wait; a trainer elsewhere:
no batch served for that long) it prints one line with what the rollouts of that wait became: groups rolled out and
dropped by reason, mean reward (and the held-out greedy accuracy where an evaluation has run), truncation, and what
to change (`astratk.dataflow.learning_signal`). With the defaults the line comes within 25 s of the wait's start and
again every `repeat_s` seconds while it lasts. No rollout arriving at all is said after `NO_ROLLOUT_S` (engines and
the first evaluation start meanwhile), with what the data layer knows of it: evaluations holding the workers, tasks out
on the workers for a while (a chunk still generating, the oldest's age and what makes batches come sooner), or no
task out at all (are the workers alive?). Each warning is counted in
the run's metrics (`starvation/<policy>/warnings`) and kept in `summary.json` (`starvation`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from astratk.dataflow.learning_signal import (
    AGENT_METRICS,
    AgentReading,
    SignalReading,
    describe,
    env_advice,
    trajectory_means,
)

NO_ROLLOUT_S = 60.0  # a wait this long with no rollout at all is said; shorter ones are engines starting
TOO_LONG_CHUNKS = 2  # a run whose first this-many chunks per rollout worker were all too long stops

EVALUATING = "the rollout workers are evaluating"  # the starvation line's words when evaluations hold them


def nothing_to_train(spec: Any, metrics: dict[str, float]) -> str | None:
    """The line that ends a run which cannot train anything, or None: every task completed so far was dropped before
    generation because its prompt leaves no room in the model's context, there are at least the first
    `TOO_LONG_CHUNKS` chunks' worth of them per rollout worker, and no group has arrived for any policy."""
    too_long = metrics.get("data/tasks_dropped_prompt_too_long", 0.0)
    completed = metrics.get("data/tasks_completed", 0.0)
    first = TOO_LONG_CHUNKS * spec.rollout.tasks_per_chunk * max(1, spec.cluster.local_rollout_workers())
    received = sum(metrics.get(f"data/{p.policy_id}/groups_received", 0.0) for p in spec.policies)
    if received or too_long < first or too_long < completed:
        return None
    return (f"nothing to train: all {too_long:.0f} tasks rolled out so far were dropped before generation, each prompt "
            "longer than the model's context (the lines above name them and the context); shorten the prompts, or "
            "use a model with a longer context. `astratk probe` checks this before a run")


@dataclass
class _Window:
    """One policy's readings: the counters when its current wait began, and when it last warned."""

    metrics: dict[str, float]
    drops: dict[str, float]
    served: float = 0.0
    served_changed: float = 0.0  # time.monotonic() when groups_served last moved (trainers in other processes)
    warned: float = 0.0


class StarvationMonitor:
    def __init__(self, spec: Any, datalayer: Any, printer: Callable[[str], None], *,
                 streams: dict[str, Any] | None = None, greedy: Callable[[str], float | None] | None = None,
                 tools: dict[str, tuple[bool, str]] | None = None, busy: Callable[[], str | None] | None = None,
                 on_nothing: Callable[[str], None] | None = None,
                 check_s: float = 5.0, after_s: float = 20.0, repeat_s: float = 60.0) -> None:
        self.spec, self.datalayer, self.print = spec, datalayer, printer
        self.on_nothing = on_nothing  # called once, with the line, when the run cannot train anything
        self.tools = dict(tools or {})  # policy -> (tools shown to its model, the tool format), for envs with tools
        self.busy = busy or (lambda: None)  # the held-out evaluations that share the rollout workers, in words
        self.streams = dict(streams or {})
        self.greedy = greedy or (lambda pid: None)
        self.check_s, self.after_s, self.repeat_s = check_s, after_s, repeat_s
        self.warnings: list[dict[str, Any]] = []  # {"policy", "time", "waited_s", "line"}
        self._windows: dict[str, _Window] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StarvationMonitor:
        self._thread = threading.Thread(target=self._loop, name="astratk-starvation", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def counters(self) -> dict[str, float]:
        """`starvation/<policy>/warnings`: the lines printed, per policy."""
        out = {f"starvation/{p.policy_id}/warnings": 0.0 for p in self.spec.policies}
        for w in self.warnings:
            out[f"starvation/{w['policy']}/warnings"] += 1.0
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.check(time.monotonic())
            except Exception as e:  # noqa: BLE001 - a view of the run; a failed reading waits for the next one
                if not getattr(self, "_reported", False):
                    self._reported = True
                    self.print(f"starvation monitor: could not read the data layer ({type(e).__name__}: {e})")

    def check(self, now: float) -> list[str]:
        """One reading (the loop calls it every `check_s`); returns the lines printed."""
        metrics = self.datalayer.metrics(timeout=10)
        if self.on_nothing is not None:
            line = nothing_to_train(self.spec, metrics)
            if line is not None:
                on_nothing, self.on_nothing = self.on_nothing, None
                on_nothing(line)
                return [line]
        drops = _group_drops(self.datalayer.drops(timeout=10))
        printed = []
        for p in self.spec.policies:
            line = self._check_policy(p.policy_id, now, metrics, drops)
            if line is not None:
                printed.append(line)
        return printed

    def _check_policy(self, pid: str, now: float, metrics: dict[str, float], drops: dict[tuple[str, str], float]
                      ) -> str | None:
        mine = {reason: n for (policy, reason), n in drops.items() if policy == pid}
        served = metrics.get(f"data/{pid}/groups_served", 0.0)
        if pid not in self.streams and metrics.get(f"data/{pid}/trainer_attached") != 1.0:
            # a trainer elsewhere that has not attached yet, or has ended: no one is waiting for a batch (the
            # deployment says when a trainer attaches or ends); a wait is measured from the next attach
            self._windows[pid] = _Window(metrics, mine, served, now)
            return None
        w = self._windows.get(pid)
        if w is None:
            w = self._windows[pid] = _Window(metrics, mine, served, now)
        if served != w.served:
            w.served, w.served_changed = served, now
        waited = self._waited(pid, now, w)
        if waited == 0.0:  # not waiting: a wait that begins later is measured from this reading
            w.metrics, w.drops, w.warned = metrics, mine, 0.0
            return None
        if waited < self.after_s:
            return None
        if w.warned and now - w.warned < self.repeat_s:
            return None
        reading = self._reading(pid, w, metrics, mine)
        if reading.groups == 0:
            if waited < NO_ROLLOUT_S:  # engines load and the first chunk generates: not yet worth a word
                return None
            evaluating = self.busy()
            line = (f"[starving] policy {pid!r}: its trainer has waited {waited:.0f}s for a batch and no rollout "
                    + (f"arrived meanwhile: {EVALUATING} ({evaluating}); evaluations share them with rollouts, so "
                       + ("rollout.concurrent_chunks: 2 (an evaluation beside a rollout chunk), " if
                          self.spec.rollout.concurrent_chunks < 2 else "")
                       + "fewer eval.max_tasks or a longer eval.interval_s lets training start sooner"
                       if evaluating else self._nothing_back(metrics)))
        elif not reading.dropped:
            return None  # data arrives and nothing is dropped: rollouts are just slower than training
        else:
            line = (f"[starving] policy {pid!r}: trainer waiting {waited:.0f}s for a batch; "
                    + describe(reading, group_size=self.spec.rollout.group_size,
                               temperature=self.spec.rollout.temperature,
                               max_new_tokens=self.spec.rollout.max_new_tokens,
                               max_staleness=self._staleness(pid)))
        w.warned = now
        self.warnings.append({"policy": pid, "time": time.time(), "waited_s": round(waited, 1), "line": line})
        self.print(line)
        return line

    def _nothing_back(self, metrics: dict[str, float]) -> str:
        """Why no rollout arrived, from the data layer's leases: tasks out on the workers for a while mean a chunk
        still generating (slow rollouts, not dead workers); none out means no worker is asking for work."""
        r = self.spec.rollout
        out, oldest = metrics.get("data/leases_outstanding", 0.0), metrics.get("data/oldest_lease_s")
        if out and oldest is not None:
            return (f"arrived meanwhile; {out:.0f} tasks are out on the rollout workers, the oldest for {oldest:.0f}s "
                    f"(a chunk is {r.tasks_per_chunk} tasks x {r.group_size} samples, up to {r.max_new_tokens} "
                    "tokens per turn): rollouts are still generating, slower than this wait. Batches come sooner "
                    "with fewer rollout.tasks_per_chunk, fewer rollout.max_new_tokens or more rollout workers; "
                    f"a task out longer than dataflow.lease_timeout_s is given to another worker")
        return ("arrived meanwhile and no task is out on a rollout worker: are the rollout workers alive? (a large "
                "model's engine can take minutes to load, and evaluations run on the same workers; the workers' log "
                "says more)")

    def _waited(self, pid: str, now: float, w: _Window) -> float:
        stream = self.streams.get(pid)
        if stream is not None:
            since = stream.waiting_since
            return 0.0 if since is None else now - since
        return now - w.served_changed  # a trainer in another process: no batch served for this long

    def _reading(self, pid: str, w: _Window, metrics: dict[str, float], drops: dict[str, float]) -> SignalReading:
        def delta(name: str) -> float:
            return metrics.get(f"data/{pid}/{name}", 0.0) - w.metrics.get(f"data/{pid}/{name}", 0.0)

        samples = delta("samples_received")
        dropped = {r: n - w.drops.get(r, 0.0) for r, n in drops.items() if n - w.drops.get(r, 0.0) > 0}
        episodes = int(delta("agent/episodes"))
        shown, fmt = self.tools.get(pid, (None, None))
        agent = AgentReading(episodes, **{name: delta(f"agent/{name}") for name in AGENT_METRICS},
                             tools_shown=shown, tool_format=fmt) if episodes else None
        return SignalReading(groups=int(delta("groups_received")), admitted=int(delta("groups_admitted")),
                             dropped=dropped, samples=int(samples),
                             reward_mean=delta("reward_sum_received") / samples if samples else None,
                             unfinished=delta("samples_unfinished") / samples if samples else None,
                             greedy_accuracy=self.greedy(pid), agent=agent,
                             env_advice=env_advice(self.spec.env, trajectory_means(metrics, pid)))

    def _staleness(self, pid: str) -> int:
        own = self.spec.policy(pid).trainer.max_staleness
        return self.spec.dataflow.max_staleness if own is None else own


def _group_drops(drops: list[Any]) -> dict[tuple[str, str], float]:
    """(policy, reason) -> groups dropped so far."""
    out: dict[tuple[str, str], float] = {}
    for d in drops:
        if d.unit == "groups":
            out[(d.policy, d.reason)] = out.get((d.policy, d.reason), 0.0) + d.count
    return out
