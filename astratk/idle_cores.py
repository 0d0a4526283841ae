"""Cores a waiting trainer lends to the rollout workers on its host.

An asynchronous local run splits the cores (`astratk.cpu.plan_threads`): the trainer gets its share, each rollout worker
its own, so that training and rollouts overlap. But a trainer spends much of a run waiting for data: the whole start
(the first batch is being generated), and every step of a rollout-bound run. Its cores then idle while the rollout
workers generate on theirs alone.

A trainer that waits for a batch says so with a file in a directory of the run on its host (`IdleMarker`: the file is
named after its process id and the threads it lends to each rollout worker there). A rollout worker's engine looks at
that directory between two decode steps (`adjust`, at most every `CHECK_EVERY_S`: a directory listing of a few
microseconds) and runs on its own threads plus the lent ones; once the trainer has its batch (the file is gone) the
engine is back on its own threads at its next step. Only processes on one host see one directory, so a worker on
another host never borrows. A marker whose process has died is ignored (its cores are free anyway, but a restarted
trainer is a new process). `cluster.lend_idle_cores: false` turns it off; it applies only under
`cluster.torch_threads: auto` in the asynchronous mode (the synchronous mode already gives each phase every core).

torch's thread count is per thread (OpenMP's and MKL's settings are thread-local once a thread has run a parallel
op), so `adjust` is called on the thread that runs the engine's forward passes.

Example:
    >>> marker = IdleMarker(run_dir_for("run-1"), lend=1)   # the trainer
    >>> with marker.waiting():                              # doctest: +SKIP
    ...     batch = stream.wait()
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHECK_EVERY_S = 0.05  # a decode step takes 10-300 ms on a CPU: a check costs far less than being late by one step


def run_dir_for(run_id: str) -> Path:
    """The run's directory of idle markers on this host."""
    return Path(tempfile.gettempdir()) / "astratk-idle-cores" / run_id


def lends(spec: Any) -> bool:
    """Whether a run (`RunSpec`) lends a waiting trainer's cores: `cluster.lend_idle_cores`, `torch_threads: auto`,
    worker processes (threads mode is one process: every core already), and the asynchronous mode."""
    c = spec.cluster
    return bool(c.lend_idle_cores and c.torch_threads == "auto" and c.processes and not spec.dataflow.synchronous)


def lend_per_worker(spec: Any, trainer_threads: int, rollout_workers_here: int) -> int:
    """Threads a waiting trainer lends to each of the `rollout_workers_here` rollout workers on its host."""
    if not lends(spec) or rollout_workers_here < 1:
        return 0
    return max(0, trainer_threads) // rollout_workers_here


class IdleMarker:
    """A trainer's side: `waiting()` holds the marker (lending `lend` threads to each rollout worker on this host)
    for as long as the trainer waits for a batch. `lend` 0 marks nothing."""

    def __init__(self, directory: Path, lend: int) -> None:
        self.directory, self.lend = Path(directory), int(lend)
        self.path = self.directory / f"{os.getpid()}-{self.lend}"

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        if self.lend < 1:
            yield
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError:  # a read-only or full temp directory: no lending, nothing else changes
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                self.path.unlink()


def lent_threads(directory: Path) -> int:
    """Threads lent to each rollout worker by the trainers now waiting on this host (markers of live processes)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    total = 0
    for name in names:
        pid, _, lend = name.partition("-")
        if pid.isdigit() and lend.isdigit() and _alive(int(pid)):
            total += int(lend)
    return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


class Lender:
    """A rollout worker's side: its own threads, the most it may use, and the run's directory. `threads()` reads the
    directory at most every `CHECK_EVERY_S` (the engines' threads share one reading)."""

    def __init__(self, directory: Path, own: int, cap: int) -> None:
        self.directory, self.own, self.cap = Path(directory), max(1, own), max(1, cap)
        self.borrowed_s = 0.0  # engine-thread seconds of work run with lent threads (this process, this run)
        self._read_at, self._want = -float("inf"), self.own
        self._lock = threading.Lock()

    def threads(self) -> int:
        now = time.monotonic()
        with self._lock:
            if now - self._read_at >= CHECK_EVERY_S:
                self._read_at = now
                self._want = min(self.cap, self.own + lent_threads(self.directory))
            return self._want


_lender: Lender | None = None
_here = threading.local()  # per engine thread: since when it has run with lent threads (None: on its own)


def install(directory: Path, own: int, cap: int) -> Lender:
    """This process's lender (a rollout worker's); replaces the one of an earlier run in the same process."""
    global _lender
    _lender = Lender(directory, own, cap)
    return _lender


def uninstall() -> None:
    global _lender
    _lender = None


def lender() -> Lender | None:
    return _lender


def adjust() -> None:
    """Set the calling thread's torch threads to the rollout worker's own plus what waiting trainers lend (a no-op in
    a process without a lender). Call it on the thread that runs the engine's forward passes, before each, and
    `settle()` when its batch is done."""
    lender = _lender
    if lender is None:
        return
    import torch

    want = lender.threads()
    settle()
    if want > lender.own:
        _here.since = time.monotonic()
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


def settle() -> None:
    """Count the calling thread's time on lent threads since its last `adjust` (the engine's batch is done, or the
    next step may run on other threads)."""
    since, lender = getattr(_here, "since", None), _lender
    _here.since = None
    if since is not None and lender is not None:
        lender.borrowed_s += time.monotonic() - since
