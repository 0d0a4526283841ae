"""Which runs' rollout services this process holds, and releasing one when its run ends.

A worker outlives runs (a long-lived `dask worker`, a local cluster kept warm for the next run), so at a run's end
every worker is asked to release that run's service (`astratk.runtime.deploy.release_services`) and to refuse it from
then on. The record lives apart from the service itself (`astratk.rollout.service`) and imports nothing heavy: the
request reaches every worker, the data layer's `control` worker too, and a worker that never generated answers it
without loading torch and transformers (about 2.5 s of CPU per worker on a 2-core machine).
"""

from __future__ import annotations

import ctypes
import gc
import threading
from collections.abc import Callable
from typing import Any

SERVICES: dict[str, Any] = {}  # run id -> its RolloutService in this process
_LOCK = threading.Lock()
_ENDED: dict[str, None] = {}  # runs whose services were released here, oldest first (a bounded record)
_ENDED_KEEP = 1000


def service_for(run_id: str, create: Callable[[], Any]) -> Any:
    """The process-wide service of run `run_id`, made by `create()` on first use; refused once the run has ended here
    (a task that was still running when its run stopped must not build the engines again)."""
    with _LOCK:
        if run_id in _ENDED:
            raise RuntimeError(f"run {run_id} has ended: its rollout service on this worker was released")
        service = SERVICES.get(run_id)
        if service is None:
            service = SERVICES[run_id] = create()
        return service


def release_service(run_id: str) -> bool:
    """Close this process's service of a run that ended (its engines: model weights, KV caches, vLLM) and refuse it
    from now on; without this each run's engines would stay in a long-lived worker's memory. True when there was
    one."""
    with _LOCK:
        service = SERVICES.pop(run_id, None)
        _ENDED[run_id] = None
        while len(_ENDED) > _ENDED_KEEP:
            del _ENDED[next(iter(_ENDED))]
    if service is None:
        return False
    service.close()
    del service
    gc.collect()  # engines hold reference cycles (models, batcher threads' closures)
    _trim_heap()
    return True


def _trim_heap() -> None:
    """Hand the freed model memory back to the OS (glibc keeps freed blocks for reuse otherwise); no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
