"""Which hardware class a rollout worker is, and how much slower it simulates being (`cluster.pools`).

`SimulatedHardware` is the worker plugin the runtime installs on each pool's workers (`astratk.runtime.pools`); the
rollout service reads it back with `worker_hardware` at every task, to stamp results with their service's class and to
pace simulated slow hardware.
"""

from __future__ import annotations

import os
from typing import Any

from distributed import WorkerPlugin, get_worker

_HARDWARE: dict[str, tuple[str, float]] = {}  # worker name -> (class, slowdown), filled by SimulatedHardware


class SimulatedHardware(WorkerPlugin):
    """A worker plugin that tells the rollout service its worker's class and simulated slowdown. It pickles by
    reference into nanny-spawned processes, and is keyed by worker name, so several in-process workers (threads
    mode) keep their own."""

    def __init__(self, worker_class: str, slowdown: float = 1.0) -> None:
        self.worker_class = worker_class
        self.slowdown = float(slowdown)
        self.name = "astratk-hardware"

    def setup(self, worker: Any) -> None:
        _HARDWARE[str(worker.name)] = (self.worker_class, self.slowdown)

    def teardown(self, worker: Any) -> None:
        _HARDWARE.pop(str(worker.name), None)


def worker_hardware(worker_name: str | None = None) -> tuple[str, float]:
    """(class, slowdown) of the worker this runs on: from its `SimulatedHardware` plugin, else from
    `ASTRATK_WORKER_CLASS` / `ASTRATK_SIM_SLOWDOWN`, else ("default", 1.0)."""
    if worker_name is None:
        try:
            worker_name = str(get_worker().name)
        except ValueError:  # not in a Dask task
            worker_name = None
    if worker_name is not None and worker_name in _HARDWARE:
        return _HARDWARE[worker_name]
    return os.environ.get("ASTRATK_WORKER_CLASS", "default"), float(os.environ.get("ASTRATK_SIM_SLOWDOWN", "1"))
